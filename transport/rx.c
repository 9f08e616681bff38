/* wtx_rx: cuts a chunk's byte stream into tensors, hashing on the way. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/copy.h"
#include "common/hash.h"
#include "transport/rx.h"

struct wtx_rx {
  const wtx_rx_tensor *t;
  size_t n;
  size_t cur;      /* tensor receiving bytes */
  uint64_t pos;    /* bytes of t[cur] filled */
  uint64_t left;   /* bytes of the chunk still to come */
  uint64_t chunk;  /* bytes of the chunk */
  int verify;
  int span;        /* checksums per tensor touched, of its bytes in the chunk */
  uint64_t *wholes; /* span chunks: per tensor, its whole XXH3, read back */
  int device;      /* dst is device memory */
  int unread;      /* dst is not read back (WTX__RX_UNREAD) */
  uint64_t stream; /* the chunk's offset in the update's stream */
  XXH3_state_t *h; /* hash of t[cur] so far, when it arrives in pieces */
  int whole;       /* t[cur] arrived in one piece: its digest is set */
  const uint8_t *looked; /* dst of the tensor whose staging was looked at */
  int fresh;       /* its staging had never been written: populate_ahead */
  uint64_t ahead;  /* its bytes before this are populated */
  uint64_t *digests; /* per tensor of the chunk, set when complete */
  size_t completed;
  const uint64_t *expected;
  size_t n_expected;
  uint64_t *carried; /* wtx_rx_checksums' copy */
  size_t carried_cap;
  /* carried across chunks: a tensor left incomplete */
  char *carry_name;
  uint64_t carry_pos, carry_nbytes;
  char err[512];
};

int wtx__rx_create(wtx_rx **out) {
  wtx_rx *rx = calloc(1, sizeof *rx);
  if (rx == NULL) return WTX_ENOMEM;
  rx->h = XXH3_createState();
  if (rx->h == NULL) {
    free(rx);
    return WTX_ENOMEM;
  }
  *out = rx;
  return 0;
}

void wtx__rx_reset(wtx_rx *rx) {
  free(rx->carry_name);
  rx->carry_name = NULL;
  rx->carry_pos = rx->carry_nbytes = 0;
  rx->t = NULL;
  rx->n = 0;
  rx->left = rx->chunk = 0;
  rx->stream = 0;
  rx->err[0] = '\0';
}

void wtx__rx_destroy(wtx_rx *rx) {
  if (rx == NULL) return;
  wtx__rx_reset(rx);
  XXH3_freeState(rx->h);
  free(rx->digests);
  free(rx->wholes);
  free(rx->carried);
  free(rx);
}

void wtx_rx_errorf(wtx_rx *rx, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(rx->err, sizeof rx->err, fmt, ap);
  va_end(ap);
}

const char *wtx__rx_error(const wtx_rx *rx) { return rx->err; }

const char *wtx__rx_incomplete(const wtx_rx *rx, uint64_t *have,
                               uint64_t *want) {
  if (rx->carry_name == NULL) return NULL;
  *have = rx->carry_pos;
  *want = rx->carry_nbytes;
  return rx->carry_name;
}

/* Moves past every tensor whose bytes are all in, recording its digest
 * (a tensor that arrived in one piece has it already). */
static void complete_filled(wtx_rx *rx) {
  while (rx->cur < rx->n && rx->pos == rx->t[rx->cur].nbytes) {
    if (!rx->whole) {
      rx->digests[rx->cur] = XXH3_64bits_digest(rx->h);
      XXH3_64bits_reset(rx->h);
    }
    /* No sender hashed the whole tensor: the model's checksum of it is
     * read back from the staging its bytes just went to. */
    if (rx->span && rx->verify && !rx->device && !rx->unread)
      rx->wholes[rx->cur] = XXH3_64bits(rx->t[rx->cur].dst, rx->t[rx->cur].nbytes);
    rx->whole = 0;
    rx->completed++;
    rx->cur++;
    rx->pos = 0;
  }
}

int wtx__rx_begin(wtx_rx *rx, const wtx_rx_tensor *tensors, size_t n,
                  uint64_t first_offset, uint64_t chunk_bytes, int flags) {
  rx->err[0] = '\0';
  if (n == 0) {
    wtx_rx_errorf(rx, "chunk has no tensors");
    return WTX_EPROTO;
  }
  /* The chunk runs from first_offset in tensors[0] to inside (or the end
   * of) tensors[n-1]. Sizes are validated (< 2^63 each) by the caller. */
  uint64_t span = 0;
  for (size_t i = 0; i < n; i++) span += tensors[i].nbytes;
  if (first_offset > 0 && first_offset >= tensors[0].nbytes) {
    wtx_rx_errorf(rx, "update_info.first_param_offset: %llu, but '%s' has %llu "
                  "bytes", (unsigned long long)first_offset, tensors[0].name,
                  (unsigned long long)tensors[0].nbytes);
    return WTX_EINVAL;
  }
  span -= first_offset;
  if (chunk_bytes == 0) chunk_bytes = span;
  if (chunk_bytes > span ||
      (chunk_bytes < span && span - chunk_bytes >= tensors[n - 1].nbytes)) {
    wtx_rx_errorf(rx, "update_info.chunk_bytes: %llu, but the chunk's "
                  "parameters end between %llu (exclusive) and %llu bytes",
                  (unsigned long long)chunk_bytes,
                  (unsigned long long)(span - tensors[n - 1].nbytes),
                  (unsigned long long)span);
    return WTX_EINVAL;
  }
  if (first_offset > 0) {
    if (rx->carry_name == NULL || strcmp(rx->carry_name, tensors[0].name) != 0 ||
        rx->carry_pos != first_offset || rx->carry_nbytes != tensors[0].nbytes) {
      wtx_rx_errorf(rx,
                    "chunk continues '%s' at byte %llu, but the previous "
                    "chunk left %s%s%s at byte %llu",
                    tensors[0].name, (unsigned long long)first_offset,
                    rx->carry_name ? "'" : "", rx->carry_name ? rx->carry_name : "no tensor incomplete",
                    rx->carry_name ? "'" : "", (unsigned long long)rx->carry_pos);
      return WTX_EPROTO;
    }
  } else if (rx->carry_name != NULL) {
    wtx_rx_errorf(rx, "tensor '%s' is incomplete (%llu of %llu bytes) but the "
                  "next chunk starts a new tensor",
                  rx->carry_name, (unsigned long long)rx->carry_pos,
                  (unsigned long long)rx->carry_nbytes);
    return WTX_EPROTO;
  } else {
    XXH3_64bits_reset(rx->h);
  }
  uint64_t *d = realloc(rx->digests, n * sizeof *d);
  if (d == NULL) return WTX_ENOMEM;
  rx->digests = d;
  if ((d = realloc(rx->wholes, n * sizeof *d)) == NULL) return WTX_ENOMEM;
  rx->wholes = d;
  rx->t = tensors;
  rx->n = n;
  rx->cur = 0;
  if (first_offset == 0) rx->looked = NULL; /* a carried tensor goes on as it was */
  rx->pos = first_offset;
  rx->stream += rx->chunk - rx->left; /* the previous chunk's bytes */
  rx->left = rx->chunk = chunk_bytes;
  rx->whole = 0;
  rx->span = 0;
  rx->verify = (flags & WTX__RX_VERIFY) != 0;
  rx->device = (flags & WTX__RX_DEVICE) != 0;
  rx->unread = (flags & WTX__RX_UNREAD) != 0;
  rx->completed = 0;
  rx->expected = NULL;
  rx->n_expected = 0;
  complete_filled(rx); /* zero-byte tensors complete at once */
  return 0;
}

int wtx__rx_expect_checksums(wtx_rx *rx, const uint64_t *xxh3, size_t n) {
  rx->expected = xxh3;
  rx->n_expected = n;
  return 0;
}

int wtx_rx_checksums(wtx_rx *rx, const uint64_t *xxh3, size_t n) {
  if (n > rx->carried_cap) {
    uint64_t *c = realloc(rx->carried, n * sizeof *c);
    if (c == NULL) return WTX_ENOMEM;
    rx->carried = c;
    rx->carried_cap = n;
  }
  if (n > 0) memcpy(rx->carried, xxh3, n * sizeof *xxh3);
  return wtx__rx_expect_checksums(rx, rx->carried, n);
}

uint64_t wtx_rx_remaining(const wtx_rx *rx) { return rx->left; }

int wtx_rx_in_region(wtx_rx *rx, uint64_t at, uint64_t region_bytes, const char *who) {
  if (at <= region_bytes && rx->left <= region_bytes - at) return 0;
  wtx_rx_errorf(rx, "%s: the chunk at byte %llu of the update (%llu bytes) lies beyond the "
                "%llu-byte receive region", who, (unsigned long long)at,
                (unsigned long long)rx->left, (unsigned long long)region_bytes);
  return WTX_EINVAL;
}

int wtx_rx_span_checksums(wtx_rx *rx) {
  if (rx->left != rx->chunk) {
    wtx_rx_errorf(rx, "span checksums asked for after the chunk's first byte");
    return WTX_EPROTO;
  }
  rx->span = 1;
  if (rx->pos > 0) XXH3_64bits_reset(rx->h); /* the tensor's earlier bytes were checked */
  return 0;
}

int wtx__rx_whole_sums(const wtx_rx *rx) {
  return rx->verify && !(rx->span && (rx->device || rx->unread));
}

/* Fresh staging (a worker's first syncs allocate it as they go) takes a
 * page fault per page where a copy first writes it. Asking the kernel to
 * populate a megabyte's pages at once does the same work for less
 * (bench/memcpy_baseline's populate figures), also ahead into the chunk
 * that continues a tensor. Pages already there would cost the walk, so
 * each tensor's staging is looked at once, by one page: mincore, then
 * only when fresh. */
#define POPULATE_MIN ((uint64_t)1 << 20) /* smaller tensors fault as they go */
#define POPULATE_AHEAD ((uint64_t)1 << 20)

#if defined(MADV_POPULATE_WRITE)
/* Whether the first whole page of [dst, +len) was never written. */
static int never_written(const uint8_t *dst, uint64_t len) {
  uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  uintptr_t a = ((uintptr_t)dst + page - 1) & ~(page - 1);
  unsigned char in = 1;
  return a + page <= (uintptr_t)dst + len && mincore((void *)a, page, &in) == 0 &&
         (in & 1) == 0;
}
#endif

/* Before t[cur] is written at pos: when its staging is fresh, the pages
 * of the next POPULATE_AHEAD bytes are made present (a hint; the copy
 * faults in whatever it leaves out). */
static void populate_ahead(wtx_rx *rx) {
#if defined(MADV_POPULATE_WRITE)
  const wtx_rx_tensor *t = &rx->t[rx->cur];
  if (rx->looked != t->dst) {
    rx->looked = t->dst;
    rx->ahead = rx->pos;
    rx->fresh = !rx->device && t->nbytes - rx->pos >= POPULATE_MIN &&
                never_written(t->dst + rx->pos, t->nbytes - rx->pos);
  }
  if (!rx->fresh || rx->pos < rx->ahead) return;
  uint64_t end = t->nbytes - rx->pos < POPULATE_AHEAD ? t->nbytes : rx->pos + POPULATE_AHEAD;
  uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  uintptr_t a = ((uintptr_t)t->dst + rx->pos + page - 1) & ~(page - 1);
  uintptr_t e = ((uintptr_t)t->dst + end) & ~(page - 1);
  if (e > a) madvise((void *)a, e - a, MADV_POPULATE_WRITE);
  rx->ahead = end;
#else
  (void)rx;
#endif
}

size_t wtx_rx_next(wtx_rx *rx, uint8_t **dst) {
  if (rx->cur >= rx->n || rx->left == 0) {
    *dst = NULL;
    return 0;
  }
  populate_ahead(rx);
  *dst = rx->t[rx->cur].dst + rx->pos;
  uint64_t left = rx->t[rx->cur].nbytes - rx->pos;
  if (left > rx->left) left = rx->left;
  return left > SIZE_MAX ? SIZE_MAX : (size_t)left;
}

int wtx_rx_on_device(const wtx_rx *rx) { return rx->device; }

int wtx_rx_verifying(const wtx_rx *rx) { return rx->verify; }

uint64_t wtx_rx_stream_offset(const wtx_rx *rx) { return rx->stream; }

uint64_t wtx__rx_next_stream_offset(const wtx_rx *rx) {
  return rx->stream + (rx->chunk - rx->left);
}

/* Hashes the k bytes at src of t[cur], at pos: a tensor that arrives in
 * one piece (every small one) is hashed at once, without the streaming
 * state's reset, update and digest (most of the cost at 16 bytes). */
static void hash_piece(wtx_rx *rx, const uint8_t *src, size_t k) {
  if (rx->pos == 0 && k == rx->t[rx->cur].nbytes) {
    rx->digests[rx->cur] = XXH3_64bits(src, k);
    rx->whole = 1;
  } else {
    XXH3_64bits_update(rx->h, src, k);
  }
}

/* Advances past len bytes, hashing them when verifying (unless hashed:
 * they are in rx->h already): from host (a copy of them, contiguous) or,
 * when NULL, where they were written in place. */
static int advance(wtx_rx *rx, size_t len, const uint8_t *host, int hashed) {
  if (len > rx->left) {
    wtx_rx_errorf(rx, "chunk carries more than its %llu bytes",
                  (unsigned long long)rx->chunk);
    return WTX_EPROTO;
  }
  rx->left -= len;
  while (len > 0) {
    if (rx->cur >= rx->n) {
      wtx_rx_errorf(rx, "chunk carries more bytes than its tensors hold");
      return WTX_EPROTO;
    }
    uint64_t left = rx->t[rx->cur].nbytes - rx->pos;
    size_t k = len < left ? len : (size_t)left;
    if (rx->verify && !hashed) hash_piece(rx, host ? host : rx->t[rx->cur].dst + rx->pos, k);
    if (host != NULL) host += k;
    rx->pos += k;
    len -= k;
    complete_filled(rx);
  }
  return 0;
}

/* A backend that does not know the chunk lives on a GPU. */
static int host_refused(wtx_rx *rx) {
  wtx_rx_errorf(rx, "device staging: the backend must copy with the CUDA runtime "
                "(wtx_rx_commit_device), not from the CPU");
  return WTX_EPROTO;
}

int wtx_rx_commit(wtx_rx *rx, size_t len) {
  if (rx->device) return host_refused(rx);
  return advance(rx, len, NULL, 0);
}

int wtx_rx_commit_device(wtx_rx *rx, size_t len, const uint8_t *host) {
  if (!rx->device || (rx->verify && host == NULL && len > 0)) {
    wtx_rx_errorf(rx, rx->device ? "verifying device staging needs a host copy of the bytes"
                                 : "device commit into host staging");
    return WTX_EPROTO;
  }
  return advance(rx, len, host, 0);
}

/* Pieces (and whole tensors) from this size on are copied with
 * non-temporal stores, hashed in the same pass (wtx__copy_hash): the
 * staging is not read again soon. Smaller ones go through memcpy and are
 * hashed from their destination, in cache. */
#define STREAM_MIN ((size_t)64 << 10)

/* Copies the whole tensors under STREAM_MIN at the front of data (len
 * bytes) into place, each hashed at once; returns the bytes taken. 40k tiny
 * tensors arrive this way, without a call per step of the general path
 * below, which takes larger ones. */
static size_t whole_tensors(wtx_rx *rx, const uint8_t *data, size_t len) {
  size_t done = 0;
  while (rx->cur < rx->n && rx->pos == 0) {
    const wtx_rx_tensor *t = &rx->t[rx->cur];
    if (t->nbytes == 0 || t->nbytes >= STREAM_MIN || t->nbytes > len - done ||
        t->nbytes > rx->left)
      break;
    memcpy(t->dst, data + done, t->nbytes);
    if (rx->verify) rx->digests[rx->cur] = XXH3_64bits(t->dst, t->nbytes);
    rx->whole = 1; /* its digest is set (unused unless verifying) */
    rx->pos = t->nbytes;
    done += t->nbytes;
    rx->left -= t->nbytes;
    complete_filled(rx); /* it, and zero-byte tensors after it */
  }
  return done;
}

int wtx_rx_bytes(wtx_rx *rx, const uint8_t *data, size_t len) {
  if (rx->device) return host_refused(rx);
  while (len > 0) {
    size_t whole = whole_tensors(rx, data, len);
    data += whole;
    len -= whole;
    if (len == 0) break;
    uint8_t *dst;
    size_t room = wtx_rx_next(rx, &dst);
    if (room == 0) {
      wtx_rx_errorf(rx, "chunk carries more than its %llu bytes",
                    (unsigned long long)rx->chunk);
      return WTX_EPROTO;
    }
    size_t k = len < room ? len : room;
    int rc;
    if (k >= STREAM_MIN) {
      wtx__copy_hash(dst, data, k, rx->verify ? rx->h : NULL, 1);
      rc = advance(rx, k, NULL, 1);
    } else {
      memcpy(dst, data, k);
      rc = wtx_rx_commit(rx, k);
    }
    if (rc != 0) return rc;
    data += k;
    len -= k;
  }
  return 0;
}

size_t wtx__rx_completed(const wtx_rx *rx) { return rx->completed; }

uint64_t wtx__rx_checksum(const wtx_rx *rx, size_t i) {
  return rx->span ? rx->wholes[i] : rx->digests[i];
}

const uint64_t *wtx__rx_checksums(const wtx_rx *rx) {
  return rx->span ? rx->wholes : rx->digests;
}

int wtx__rx_end(wtx_rx *rx) {
  if (rx->left > 0) {
    wtx_rx_errorf(rx, "chunk ended early: %llu of %llu bytes (tensor '%s' got "
                  "%llu of %llu)", (unsigned long long)(rx->chunk - rx->left),
                  (unsigned long long)rx->chunk, rx->t[rx->cur].name,
                  (unsigned long long)rx->pos,
                  (unsigned long long)rx->t[rx->cur].nbytes);
    return WTX_EPROTO;
  }
  if (rx->verify) {
    /* With span checksums the tensor left incomplete has one too. */
    size_t sums = rx->completed + (rx->span && rx->cur < rx->n);
    if (sums > rx->completed) rx->digests[rx->cur] = XXH3_64bits_digest(rx->h);
    if (rx->n_expected != sums) {
      wtx_rx_errorf(rx, "chunk %s %zu tensors but carries %zu checksums",
                    rx->span ? "touches" : "completes", sums, rx->n_expected);
      return WTX_EPROTO;
    }
    for (size_t i = 0; i < sums; i++) {
      if (rx->digests[i] != rx->expected[i]) {
        /* The hash of what arrived is never echoed: it says something of
         * bytes the caller may not own. */
        wtx_rx_errorf(rx,
                      "checksum mismatch for '%s': the bytes received do not "
                      "hash to the sender's xxh3",
                      rx->t[i].name);
        return WTX_ECHECKSUM;
      }
    }
  }
  free(rx->carry_name);
  rx->carry_name = NULL;
  if (rx->cur < rx->n) {
    rx->carry_name = strdup(rx->t[rx->cur].name);
    if (rx->carry_name == NULL) return WTX_ENOMEM;
    rx->carry_pos = rx->pos;
    rx->carry_nbytes = rx->t[rx->cur].nbytes;
  }
  return 0;
}
