"""Combines make profile's per-cell tables (target/profile/{path}-{cell}.md) into two tables
for docs/benchmarks.md: Envoy's CPU by thread and binary, and the scorer's CPU by stage, one column
per path and cell. Usage: python3 profile_summary.py target/profile > summary.md"""
import pathlib
import sys

PATHS = ["wasm", "native", "epp"]
CELLS = ["short", "long", "chat"]


def tables(text):
    """The markdown tables of a file, as {header's first cell: {row label: value}}."""
    found, current = {}, None
    for line in text.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if current is None:
            current = found.setdefault(cells[0], {})
        elif not set(cells[0]) <= {"-"}:
            current[cells[0]] = cells[1]
    return found


def combined(directory, key):
    columns = [(p, c) for p in PATHS for c in CELLS if (directory / f"{p}-{c}.md").exists()]
    data = {col: tables((directory / f"{col[0]}-{col[1]}.md").read_text()).get(key, {}) for col in columns}
    rows = []
    for col in columns:
        rows += [r for r in data[col] if r not in rows]
    out = [f"| {key} | " + " | ".join(f"{p}: {c}" for p, c in columns) + " |"]
    out.append("|---" * (len(columns) + 1) + "|")
    for row in rows:
        out.append(f"| {row} | " + " | ".join(data[col].get(row, "–") for col in columns) + " |")
    return "\n".join(out)


def main():
    directory = pathlib.Path(sys.argv[1])
    print(combined(directory, "Envoy thread: binary"))
    print()
    print(combined(directory, "scorer stage"))


if __name__ == "__main__":
    main()
