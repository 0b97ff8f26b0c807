# Sourced by the benchmark scripts: start a local stack (`tandem up`) and stop it again.
#   stack_up TANDEM PORT LOG [extra `tandem up` options...]   # returns once "Tandem is up" is logged
#   stack_down
# The stack is stopped on exit too. TANDEM is the executable whose build serves (another checkout's
# for a before/after pair); the clients run from this checkout.

# A stack started right after another on the same ports could fail to bind them while the earlier
# stack's services were still draining (seen once on back-to-back runs): wait until both are free.
ports_free() {  # ports_free PORT...: nothing listens on any of them
  python3 - "$@" <<'PY'
import socket, sys
for port in sys.argv[1:]:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
        try:
            s.bind(("0.0.0.0", int(port)))
        except OSError:
            sys.exit(1)
PY
}

stack_up() {
  local tandem port=$2 log
  tandem=$(realpath "$1")
  log=$(realpath -m "$3")
  shift 3
  for i in $(seq 61); do
    ports_free "$port" $((port + 1)) && break
    [ "$i" = 61 ] && { echo "ports $port and $((port + 1)) are still taken after 60 s" >&2; return 1; }
    sleep 1
  done
  # From the checkout that holds TANDEM (.../.venv/bin/tandem): `python -m` puts the working
  # directory first on the path, so another checkout's modules would be mixed in.
  (cd "$(dirname "$tandem")/../.." && exec "$tandem" up --grpc-port "$port" --http-port $((port + 1)) "$@") > "$log" 2>&1 &
  STACK_PID=$!
  trap stack_down EXIT
  for _ in $(seq 240); do
    grep -q "Tandem is up" "$log" 2>/dev/null && return 0
    kill -0 "$STACK_PID" 2>/dev/null || { echo "the stack exited; see $log" >&2; return 1; }
    sleep 1
  done
  echo "the stack did not come up in 240 s; see $log" >&2
  return 1
}

stack_down() {
  if [ -n "${STACK_PID:-}" ]; then
    kill "$STACK_PID" 2>/dev/null || true
    wait "$STACK_PID" 2>/dev/null || true
    STACK_PID=
  fi
  trap - EXIT
}

# bench_setup SUBDIR: OUT=docs/results/<host>/SUBDIR (made, with this host's lscpu in cpu.txt) and
# T=the checkout's tandem CLI, for the recipes that measure on this host.
bench_setup() {
  HOST=${HOST:-$(lscpu | grep -qi amd && echo epyc || echo intel)}
  OUT=docs/results/$HOST/$1
  mkdir -p "$OUT"
  lscpu > "$OUT/cpu.txt"
  T=.venv/bin/tandem
}

# before_tree REV [DIR]: a git worktree of REV at DIR (default /tmp/tandem-before) with its own
# editable install sharing this checkout's packages (torch and the rest), for before/after pairs in
# one sitting; sets TREE. Kept between runs: a second call reuses it.
before_tree() {
  TREE=${2:-/tmp/tandem-before}
  # a tree left by an earlier pair at another revision is made again (it once served the wrong build)
  if [ -d "$TREE" ] && [ "$(git -C "$TREE" rev-parse HEAD 2>/dev/null)" != "$(git rev-parse "$1^{commit}")" ]; then
    git worktree remove --force "$TREE"
  fi
  if [ ! -x "$TREE/.venv/bin/tandem" ]; then
    git worktree add -f "$TREE" "$1"
    python3 -m venv "$TREE/.venv"
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    tsite=$("$TREE/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$site" > "$tsite/tandem_packages.pth"
    "$TREE/.venv/bin/pip" install -q --no-deps -e "$TREE"
  fi
}
