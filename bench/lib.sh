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
