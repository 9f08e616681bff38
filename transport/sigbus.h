/* Reads of a shared mapping that another process may shrink under us.
 *
 * A mapped file read past its end raises SIGBUS, which kills the process.
 * The shm backend maps the trainer's region (one copy per byte, where pread
 * costs a second pass through the kernel's page lookup), so a trainer that
 * truncates its region mid-chunk must end that chunk with an error, not the
 * worker. wtx__sigbus_guard runs a copy with such faults turned into an
 * error: a process-wide SIGBUS handler, installed on first use, jumps back
 * out of the copy when the faulting address lies in the guarded range of the
 * faulting thread; any other SIGBUS goes to the handler that was there
 * before (the default one kills, as always). */
#ifndef WTX_TRANSPORT_SIGBUS_H
#define WTX_TRANSPORT_SIGBUS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Runs fn(arg) with SIGBUS on [base, +len) turned into a return of
 * WTX_EIO; otherwise returns what fn returns. fn may be abandoned at any
 * instruction that reads the range, so it must only copy and hash: no
 * locks, no allocation, nothing that must be undone. One guard per thread
 * at a time (nested calls guard the innermost range). WTX_EIO too when the
 * handler cannot be installed. */
int wtx__sigbus_guard(const void *base, size_t len, int (*fn)(void *), void *arg);

#ifdef __cplusplus
}
#endif
#endif /* WTX_TRANSPORT_SIGBUS_H */
