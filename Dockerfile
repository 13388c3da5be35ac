# Build: docker build -t tollgate .
# Run:   docker run -p 8080:8080 -e TOLLGATE__REDIS__URL=redis://redis:6379 tollgate
FROM rust:1-bookworm AS build
WORKDIR /src
# Dependencies first, so source edits reuse the cached layer.
# The workspace's other members (the test kit, the load tool) only need to exist here.
COPY Cargo.toml Cargo.lock ./
COPY testkit/Cargo.toml testkit/
COPY bench/Cargo.toml bench/
RUN mkdir -p src testkit/src bench/src && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs testkit/src/lib.rs && echo 'fn main() {}' > bench/src/main.rs \
    && cargo build --release --locked -p tollgate && rm -rf src testkit/src bench/src
COPY . .
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin tollgate

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /app --shell /usr/sbin/nologin tollgate \
    && mkdir -p /app/data && chown tollgate /app/data
WORKDIR /app
COPY --from=build /src/target/release/tollgate /usr/local/bin/tollgate
COPY config ./config
USER tollgate
ENV TOLLGATE__SERVER__LISTEN=0.0.0.0:8080
EXPOSE 8080
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/tollgate"]
CMD ["serve"]
