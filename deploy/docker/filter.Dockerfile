# The kvgate filter as an OCI image in the layout Istio's WasmPlugin and Kubernetes image
# volumes accept: one layer holding plugin.wasm at the root. From the repository root,
#   docker build -f deploy/docker/filter.Dockerfile -t kvgate-filter .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN rustup target add wasm32-wasip1 \
 && cargo build --release --locked -p kvgate-filter --target wasm32-wasip1

FROM scratch
COPY --from=build /src/target/wasm32-wasip1/release/kvgate_filter.wasm /plugin.wasm
