# Sourced by the benchmark scripts that drive xinference-local through its CLI
# (run_h200_vllm.sh, run_h200_8b.sh, run_write_path.sh). Needs LOGS, the folder of
# the server's log; PY, the Python to run (python3 if unset).
SERVER_PID=
SERVER_LOG=
start_server() {  # start_server PORT [VAR=value ...]: xinference-local in the background
  local port=$1; shift
  SERVER_LOG=$LOGS/local-$port.log
  env "$@" "${PY:-python3}" -m xinference.deploy.cmdline local --port "$port" \
    > "$SERVER_LOG" 2>&1 &
  SERVER_PID=$!
  EP=http://127.0.0.1:$port
  for _ in $(seq 240); do
    grep -q "Xinference serving at" "$SERVER_LOG" && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || break  # it exited: no point waiting
    sleep 0.5
  done
  echo "xinference-local did not start"; tail -20 "$SERVER_LOG"; return 1
}
stop_server() {  # SIGINT: the server terminates its models, so no engine outlives it
  [[ -n $SERVER_PID ]] && kill -INT "$SERVER_PID" && wait "$SERVER_PID"
  SERVER_PID=
}
xi() {  # xi LIMIT_S ARGS...: the xinference CLI against the server, cut at LIMIT_S
  local limit=$1; shift
  timeout "$limit" "${PY:-python3}" -m xinference.deploy.cmdline --endpoint "$EP" "$@"
}
