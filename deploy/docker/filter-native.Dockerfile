# The kvgate filter as a native Envoy dynamic module (for Envoy 1.40.x, whose dynamic-module
# ABI it is built against): one layer holding libkvgate_filter_native.so at the root,
# mountable as a Kubernetes image volume. From the repository root,
#   docker build -f deploy/docker/filter-native.Dockerfile -t kvgate-filter-native .
# Built on Debian bookworm (glibc 2.36): loads in Envoy's images, whose glibc is newer.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvgate-filter-native

FROM scratch
COPY --from=build /src/target/release/libkvgate_filter_native.so /libkvgate_filter_native.so
