# kvpages in a container: the server with the wasm plugin and the browser simulator embedded,
# running as a non-root user with its state in a volume.
#
#   docker build -t kvpages .
#   docker run -d --name kvpages -p 18000:18000 -v kvpages-data:/var/lib/kvpages \
#       -e KVPAGES_ADMIN_TOKEN=<secret> kvpages
#
# Two ways to get the binary, picked by KVPAGES_BINARY:
#   source   (the default) builds it here, in the rust image, as `cargo xtask wheel` does;
#   prebuilt copies target/release/kvpages (or the file KVPAGES_BINARY_PATH names) from the
#            build context, built beforehand by `cargo xtask plugin && cargo xtask simulator &&
#            cargo build --release -p kvpages`. `cargo xtask image` does this, and the tests
#            build and run the image this way.
#
# The container serves on 0.0.0.0:18000 (inside it); every `kvpages serve` flag can be given as
# a KVPAGES_* variable (`-e KVPAGES_WORLD_SIZE=8`) or after the image name
# (`docker run ... kvpages serve --world-size 8`). The data routes carry no authentication
# (neither does the peers' protocol): publish the port only on a trusted network, and use
# KVPAGES_ALLOW / KVPAGES_ADMIN_TOKEN (docs/operations.md, "Exposure beyond loopback"). With -p, the
# server sees Docker's gateway address for clients from outside, so --allow cannot tell them
# apart there; use --network host when --allow must see the real addresses.

ARG KVPAGES_BINARY=source
# The runtime's base (the tests give a locally made Debian 12 when no registry is reachable).
ARG KVPAGES_BASE=debian:bookworm-slim

# ---- the binary, built from source ------------------------------------------------------------
# rust-version of kvpages-host (wasmtime 48 needs 1.95).
FROM rust:1.95-bookworm AS binary-source
WORKDIR /src
# The plugin and the simulator are compiled for wasm32 through rustup's target; the simulator's
# module needs wasm-bindgen-cli (cargo install) and Node.js (apt), which its xtask step installs.
RUN rustup target add wasm32-unknown-unknown
COPY . .
RUN KVPAGES_WASM_ROUTE=rustup cargo xtask plugin \
 && KVPAGES_WASM_ROUTE=rustup cargo xtask simulator \
 && cargo build --release --locked -p kvpages --bin kvpages \
 && install -D -m 0755 target/release/kvpages /out/kvpages

# ---- the binary, built beforehand ---------------------------------------------------------------
FROM scratch AS binary-prebuilt
ARG KVPAGES_BINARY_PATH=target/release/kvpages
COPY ${KVPAGES_BINARY_PATH} /out/kvpages

FROM binary-${KVPAGES_BINARY} AS binary

# ---- run ------------------------------------------------------------------------------------
FROM ${KVPAGES_BASE}
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/kvpages --create-home \
        --shell /usr/sbin/nologin kvpages
COPY --from=binary --chmod=0755 /out/kvpages /usr/local/bin/kvpages
USER 10001:10001
WORKDIR /var/lib/kvpages
# The write-ahead log and snapshots: mount a volume here so the state outlives the container.
VOLUME /var/lib/kvpages
ENV KVPAGES_HOST=0.0.0.0 \
    KVPAGES_DATA_DIR=/var/lib/kvpages/data
EXPOSE 18000
# `kvpages stats` exits non-zero unless the server answers (503 while recovering, hence the
# start period). It dials 127.0.0.1: keep loopback in KVPAGES_ALLOW if you set one.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["kvpages", "stats"]
# SIGTERM (docker stop): open requests finish, a last snapshot is written.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvpages"]
CMD ["serve"]
