# Sourced by the bench scripts (bench/common.sh, bench/ab.sh): helpers that
# build and start nothing.

# cpu_ticks PID...: the CPU the processes have used so far, utime + stime
# summed over them, in clock ticks (getconf CLK_TCK a second).
cpu_ticks() {
  local p n=0
  for p in "$@"; do n=$((n + $(awk '{print $14 + $15}' /proc/"$p"/stat))); done
  echo $n
}
