# --- dpu-kvtier: install the agent into the target root (bfb_modify_os) --------------------
# The payload (wheels, config, units) is below, base64 of a tar; DPUKV_PAYLOAD_URL fetches it
# instead (e.g. from the provisioning host over tmfifo_net0). DPUKV_TARGET_ROOT, DPUKV_PYTHON
# and DPUKV_NO_CHROOT exist for tests: a scratch directory standing in for /mnt.
DPUKV_TARGET_ROOT=${DPUKV_TARGET_ROOT:-/mnt}

dpukv_install() (
    set -eu
    root=$1
    log() { echo "dpukv: $*" >&2; }
    payload=$root/opt/dpukv/payload
    rm -rf "$payload"
    mkdir -p "$payload"
    if [ -n "${DPUKV_PAYLOAD_URL:-}" ]; then
        curl -fsSL "$DPUKV_PAYLOAD_URL" | tar -x -C "$payload"
    else
        dpukv_payload | tar -x -C "$payload"
    fi
    # Inside the new root (chroot, its python3) on a real install; else the scratch-root mode.
    run=()
    mounted=()
    trap 'for m in "${mounted[@]}"; do umount "$m" || true; done' EXIT
    inner=$root
    if [ "$root" != / ] && [ -x "$root/usr/bin/python3" ] && [ -z "${DPUKV_NO_CHROOT:-}" ]; then
        for fs in proc sys dev; do
            if ! mountpoint -q "$root/$fs"; then
                mount --bind "/$fs" "$root/$fs"
                mounted+=("$root/$fs")
            fi
        done
        run=(chroot "$root")
        inner=
    fi
    py=${DPUKV_PYTHON:-python3}
    if ! "${run[@]}" "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        log "the image's python3 is older than 3.11 (dpu-kvtier needs 3.11+): use an Ubuntu 24.04 BFB"
        exit 1
    fi
    venv=$inner/opt/dpukv/venv
    log "creating $venv"
    "${run[@]}" "$py" -m venv --clear "$venv"
    cd /  # -I and / : the installed package, never one in the caller's directory
    "${run[@]}" "$venv/bin/python" -I -m pip install --quiet --no-index --disable-pip-version-check \
        --find-links "$inner/opt/dpukv/payload/wheels" 'dpu-kvtier[agent]'
    if ! "${run[@]}" "$venv/bin/python" -I -m dpu_agent.crypto._build >/dev/null 2>&1; then
        log "WARNING: AES-XTS sector loop not built (the image needs gcc, libssl-dev and libxxhash-dev); dpuctl doctor reports it"
    fi
    install -d -m 0755 "$root/etc/dpukv" "$root/etc/systemd/system/multi-user.target.wants" \
        "$root/usr/lib/sysusers.d"
    cp -R "$payload/etc/dpukv/." "$root/etc/dpukv/"
    chmod -R go-w "$root/etc/dpukv"
    install -m 0644 "$payload/sysusers.d/dpukv.conf" "$root/usr/lib/sysusers.d/dpukv.conf"
    for unit in "$payload"/systemd/*.service; do
        name=${unit##*/}
        install -m 0644 "$unit" "$root/etc/systemd/system/$name"
        ln -sf "../$name" "$root/etc/systemd/system/multi-user.target.wants/$name"
    done
    if [ -e "$payload/systemd/dpukv-firstboot.service" ]; then
        touch "$root/etc/dpukv/firstboot"
    fi
    log "installed: $("${run[@]}" "$venv/bin/dpuctl" --version)"
)

bfb_modify_os() {
    dpukv_install "$DPUKV_TARGET_ROOT"
}
