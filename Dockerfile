# The gateway's container image (README, "Docker").
# Build: docker build -t tollgate .
# Run:   docker run -p 8080:8080 tollgate      (embedded store; compose.yaml adds Redis)
#
# .ci/dockerfile-check runs this file's COPY and RUN steps without a Docker engine and
# fails on any instruction it does not understand: check there before adding one.

# The toolchain and cargo-chef. Debian 12, like the runtime stage: the same glibc.
FROM rust:1-bookworm AS chef
WORKDIR /src
RUN cargo install cargo-chef --locked --version 0.1.78

# The recipe: every manifest, target and the lock file, whatever the layout (workspace
# members, benches, more binaries). It changes only when they do.
FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

# Dependencies from the recipe and vendor/: this layer stays cached while neither changes.
# Then the gateway itself, from the full tree.
FROM chef AS build
COPY --from=planner /src/recipe.json recipe.json
# vendor/: patched copies of dependencies (the root Cargo.toml's [patch.crates-io]; see
# vendor/actix-http/PATCHES.md). Not workspace members, so not in the recipe: cook builds
# them from their sources like any other dependency.
COPY vendor vendor
RUN cargo chef cook --release --locked --bin tollgate --recipe-path recipe.json
COPY . .
RUN cargo build --release --locked --bin tollgate && mkdir -p /out/data

# The runtime: glibc and libgcc (all the binary links), no shell, no package manager,
# user nonroot (65532). No configuration file: config/default.toml is compiled in, and
# TOLLGATE__* variables or a mounted file (--config) configure the rest.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/tollgate /usr/local/bin/tollgate
# data/: where the embedded store keeps its catalog (data/catalog.json), writable by
# the user, so a volume mounted there starts with the right owner.
COPY --from=build --chown=65532:65532 /out/ /home/nonroot/
WORKDIR /home/nonroot
USER 65532:65532
ENV TOLLGATE__SERVER__LISTEN=0.0.0.0:8080
EXPOSE 8080
STOPSIGNAL SIGTERM
# No curl in the image: the binary asks its own /healthz.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["/usr/local/bin/tollgate", "healthcheck"]
ENTRYPOINT ["/usr/local/bin/tollgate"]
CMD ["serve"]
