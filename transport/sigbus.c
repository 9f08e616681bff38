/* SIGBUS on a guarded range becomes an error (sigbus.h). */
#include "transport/sigbus.h"

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>

#include "wtx/error.h"

typedef struct guard {
  sigjmp_buf jump;
  const uint8_t *lo, *hi;
} guard;

/* The running guard of this thread; set and read on the thread itself (the
 * handler runs on the thread that faulted). */
static _Thread_local guard *volatile current;
static struct sigaction previous;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int installed;

/* Returns to the disposition that was there before ours. Returning from a
 * fault handler re-runs the access, so SIG_DFL makes it fatal as usual. */
static void pass_on(int sig, siginfo_t *si, void *uc) {
  if (previous.sa_flags & SA_SIGINFO) {
    previous.sa_sigaction(sig, si, uc);
  } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
  } else {
    signal(sig, SIG_DFL);
  }
}

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
  guard *g = current;
  const uint8_t *at = si->si_addr;
  /* si_code > 0: raised by the kernel for this access, not sent. */
  if (g != NULL && si->si_code > 0 && at >= g->lo && at < g->hi) {
    current = NULL;
    siglongjmp(g->jump, 1);
  }
  pass_on(sig, si, uc);
}

static void install(void) {
  struct sigaction sa = {.sa_sigaction = on_sigbus, .sa_flags = SA_SIGINFO | SA_ONSTACK};
  sigemptyset(&sa.sa_mask);
  installed = sigaction(SIGBUS, &sa, &previous) == 0;
}

int wtx__sigbus_guard(const void *base, size_t len, int (*fn)(void *), void *arg) {
  pthread_once(&once, install);
  if (!installed) return WTX_EIO;
  guard g = {.lo = base, .hi = (const uint8_t *)base + len};
  guard *outer = current;
  /* 1: the signal mask (SIGBUS blocked in the handler) is restored too. */
  if (sigsetjmp(g.jump, 1) != 0) {
    current = outer;
    return WTX_EIO;
  }
  current = &g;
  int rc = fn(arg);
  current = outer;
  return rc;
}
