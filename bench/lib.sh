# Sourced by the bench scripts (bench/common.sh, bench/ab.sh): helpers that
# build and start nothing.

# cpu_ticks PID...: the CPU the processes have used so far, utime + stime
# summed over them, in clock ticks (getconf CLK_TCK a second).
cpu_ticks() {
  local p n=0
  for p in "$@"; do n=$((n + $(awk '{print $14 + $15}' /proc/"$p"/stat))); done
  echo $n
}

# tp_rules FILE: the shard rules of the benchmarks' tensor-parallel workers
# (the synthetic model's attention and MLP split the Megatron way).
tp_rules() {
  cat >"$1" <<'RULES'
*.q_proj.weight dim 0
*.k_proj.weight dim 0
*.v_proj.weight dim 0
*.o_proj.weight dim 1
*.up_proj.weight dim 0
*.down_proj.weight dim 1
model.embed_tokens.weight dim 0
RULES
}

# goal NAME FIGURE BASELINE CMP WANT: records one goal of the run for the
# summary bench/run.sh prints first (and --json writes): FIGURE (a ratio to
# BASELINE, measured in the same run) must be CMP ("ge" or "le") WANT.
# Appends a tab-separated line to $WTX_BENCH_GOALS when that is set (run.sh
# sets it for the scripts it calls); a script run alone records nothing.
goal() {
  [ -n "${WTX_BENCH_GOALS:-}" ] || return 0
  local met
  met=$(awk -v f="$2" -v w="$5" -v c="$4" \
    'BEGIN {if (f == "" || f == "n/a") print "n/a"; else print (c == "ge" ? f + 0 >= w + 0 : f + 0 <= w + 0) ? "met" : "not met"}')
  printf "%s\t%s\t%s\t%s %s\t%s\n" "$1" "$2" "$3" "$([ "$4" = ge ] && echo ">=" || echo "<=")" \
    "$5" "$met" >>"$WTX_BENCH_GOALS"
}

# free_port: a port free now, below the ephemeral range, so no port-0
# listener or connection takes it before a rank listens on it.
free_port() {
  python3 -c 'import random, socket
while True:
    p = random.randrange(20000, 32000)
    try:
        socket.socket().bind(("127.0.0.1", p)); print(p); break
    except OSError: pass'
}
