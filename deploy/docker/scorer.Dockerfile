# kvgate-scorer (and kvgate-envoy-config): built from the repository root,
#   docker build -f deploy/docker/scorer.Dockerfile -t kvgate-scorer .
# Multi-stage: a Rust toolchain builds, a distroless image (no shell, non-root) runs.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvgate-scorer --bin kvgate-scorer --bin kvgate-envoy-config

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/kvgate-scorer /src/target/release/kvgate-envoy-config /usr/local/bin/
# distroless "nonroot"
USER 65532:65532
EXPOSE 7070 9090
ENTRYPOINT ["/usr/local/bin/kvgate-scorer"]
CMD ["--config", "/etc/kvgate/scorer.yaml"]
