# kvpages in a container: a multi-stage build (the wasm plugin the server embeds, then the
# release binary; unlike `cargo xtask serve`, not the browser simulator, so /simulator/ says it
# was built without it), and a small runtime image.
#
#   docker build -t kvpages .
#   docker run -d --name kvpages -p 18000:18000 -v kvpages-data:/var/lib/kvpages \
#       -e KVPAGES_ADMIN_TOKEN=<secret> kvpages
#
# The container serves on 0.0.0.0:18000 (inside it); every `kvpages serve` flag can be given as
# a KVPAGES_* variable (`-e KVPAGES_WORLD_SIZE=8`) or after the image name
# (`docker run ... kvpages serve --world-size 8`). The data routes carry no authentication
# (neither does the peers' protocol): publish the port only on a trusted network, and use
# KVPAGES_ALLOW / KVPAGES_ADMIN_TOKEN (docs/operations.md, "Exposure beyond loopback"). With -p, the
# server sees Docker's gateway address for clients from outside, so --allow cannot tell them
# apart there; use --network host when --allow must see the real addresses.

# ---- build ----------------------------------------------------------------------------------
# rust-version of kvpages-host (wasmtime 48 needs 1.95).
FROM rust:1.95-bookworm AS build
WORKDIR /src
# The plugin is compiled for wasm32 through rustup's target (the xtask's "rustup" route).
RUN rustup target add wasm32-unknown-unknown
COPY . .
RUN KVPAGES_WASM_ROUTE=rustup cargo xtask plugin \
 && cargo build --release --locked -p kvpages-host --bin kvpages \
 && install -m 0755 target/release/kvpages /usr/local/bin/kvpages

# ---- run ------------------------------------------------------------------------------------
FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --home-dir /var/lib/kvpages --create-home --shell /usr/sbin/nologin kvpages
COPY --from=build /usr/local/bin/kvpages /usr/local/bin/kvpages
USER kvpages
WORKDIR /var/lib/kvpages
# The write-ahead log and snapshots: mount a volume here so the state outlives the container.
VOLUME /var/lib/kvpages
ENV KVPAGES_HOST=0.0.0.0 \
    KVPAGES_DATA_DIR=/var/lib/kvpages/data
EXPOSE 18000
# `kvpages stats` exits non-zero unless the server answers (503 while recovering, hence the
# start period). It dials 127.0.0.1: keep loopback in KVPAGES_ALLOW if you set one.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD kvpages stats > /dev/null || exit 1
# SIGTERM (docker stop): open requests finish, a last snapshot is written.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvpages"]
CMD ["serve"]
