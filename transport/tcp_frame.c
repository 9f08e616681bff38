/* The tcp backend's hello and frame header (see tcp_frame.h). */
#include "transport/tcp_frame.h"

#include <stdio.h>
#include <string.h>

#include "wtx/error.h"

static const char hello_magic[4] = {'W', 'T', 'X', 'H'};
static const char frame_magic[4] = {'W', 'T', 'X', 'C'};
static const char trailer_magic[4] = {'W', 'T', 'X', 'S'};
static const char who_magic[4] = {'W', 'T', 'X', 'W'};
static const char plan_magic[4] = {'W', 'T', 'X', 'P'};
static const char diff_magic[4] = {'W', 'T', 'X', 'D'};
static const char go_magic[4] = {'W', 'T', 'X', 'G'};
static const char delta_magic[4] = {'W', 'T', 'X', 'X'};
static const char ring_magic[4] = {'W', 'T', 'X', 'R'};
static const char host_region_magic[4] = {'W', 'T', 'X', 'M'};
enum { VERSION = 1 };

static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint64_t get64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

void wtx__tcp_hello_encode(uint8_t *h, const uint8_t *token, size_t len) {
  memset(h, 0, WTX__TCP_HELLO_BYTES);
  memcpy(h, hello_magic, 4);
  put32(h + 4, VERSION);
  put32(h + 8, (uint32_t)len);
  memcpy(h + 12, token, len);
}

int wtx__tcp_hello_check(const uint8_t *h, const uint8_t *token, size_t len) {
  int ok = memcmp(h, hello_magic, 4) == 0 && get32(h + 4) == VERSION &&
           get32(h + 8) == len && memcmp(h + 12, token, len) == 0;
  return ok ? 0 : WTX_EAUTH;
}

/* The 16-byte records (who, plan, diff, ring, go): a magic, a 32-bit
 * field and a 64-bit one. get16 is 0 when the magic is magic and the
 * 32-bit field at most max32. */
static void put16(uint8_t *r, const char *magic, uint32_t a, uint64_t b) {
  memcpy(r, magic, 4);
  put32(r + 4, a);
  put64(r + 8, b);
}

static int get16(const uint8_t *r, const char *magic, uint32_t max32, uint32_t *a,
                 uint64_t *b) {
  if (memcmp(r, magic, 4) != 0 || get32(r + 4) > max32) return WTX_EPROTO;
  *a = get32(r + 4);
  *b = get64(r + 8);
  return 0;
}

void wtx__tcp_who_encode(uint8_t *w, uint32_t index, uint64_t digest) {
  put16(w, who_magic, index, digest);
}

int wtx__tcp_who_decode(const uint8_t *w, uint32_t *index, uint64_t *digest) {
  return get16(w, who_magic, UINT32_MAX, index, digest);
}

void wtx__tcp_plan_encode(uint8_t *p, uint64_t digest) { put16(p, plan_magic, 0, digest); }

int wtx__tcp_plan_decode(const uint8_t *p, uint64_t *digest) {
  uint32_t zero;
  return get16(p, plan_magic, 0, &zero, digest);
}

void wtx__tcp_diff_encode(uint8_t *d, uint64_t index, uint32_t text_len) {
  put16(d, diff_magic, text_len, index);
}

int wtx__tcp_diff_decode(const uint8_t *d, uint64_t *index, uint32_t *text_len) {
  return get16(d, diff_magic, WTX__TCP_DIFF_TEXT_MAX, text_len, index);
}

void wtx__tcp_ring_encode(uint8_t *r, uint64_t cap, uint32_t name_len, int region) {
  put16(r, region ? host_region_magic : ring_magic, name_len, cap);
}

int wtx__tcp_ring_decode(const uint8_t *r, uint64_t *cap, uint32_t *name_len, int *region) {
  *region = memcmp(r, host_region_magic, 4) == 0;
  int rc = get16(r, *region ? host_region_magic : ring_magic, 255, name_len, cap);
  return rc == 0 && *name_len == 0 ? WTX_EPROTO : rc;
}

void wtx__tcp_go_encode(uint8_t *g, uint64_t generation, uint32_t payload_len) {
  put16(g, go_magic, payload_len, generation);
}

int wtx__tcp_go_decode(const uint8_t *g, uint64_t *generation, uint32_t *payload_len) {
  return get16(g, go_magic, WTX__TCP_GO_PAYLOAD_MAX, payload_len, generation);
}

void wtx__tcp_delta_encode(uint8_t *d, uint32_t kind, uint64_t len) {
  put16(d, delta_magic, kind, len);
}

int wtx__tcp_delta_decode(const uint8_t *d, uint32_t kind, uint64_t *len) {
  uint32_t k = 0;
  if (get16(d, delta_magic, UINT32_MAX, &k, len) != 0 || k != kind ||
      *len > WTX__TCP_DELTA_PAYLOAD_MAX)
    return WTX_EPROTO;
  return 0;
}

void wtx__tcp_patch_encode(uint8_t *rec, uint32_t piece, uint64_t count, uint64_t result) {
  put32(rec, piece);
  put32(rec + 4, 0);
  put64(rec + 8, count);
  put64(rec + 16, result);
}

void wtx__tcp_ask_encode(uint8_t *rec, uint8_t flags, uint64_t seq, uint64_t landed) {
  memset(rec, 0, 8);
  rec[0] = flags;
  put64(rec + 8, seq);
  put64(rec + 16, landed);
}

int wtx__tcp_ask_decode(const uint8_t *rec, uint8_t *flags, uint64_t *seq, uint64_t *landed) {
  static const uint8_t zero[7];
  *flags = rec[0];
  *seq = get64(rec + 8);
  *landed = get64(rec + 16);
  return memcmp(rec + 1, zero, sizeof zero) == 0 && *seq > 0 && *landed < *seq ? 0
                                                                              : WTX_EPROTO;
}

int wtx__tcp_patch_decode(const uint8_t *rec, uint32_t *piece, uint64_t *count,
                          uint64_t *result) {
  *piece = get32(rec);
  *count = get64(rec + 8);
  *result = get64(rec + 16);
  return get32(rec + 4) == 0 && *count > 0 ? 0 : WTX_EPROTO;
}

void wtx__tcp_frame_encode(uint8_t *f, const wtx__tcp_frame *fr) {
  memcpy(f, frame_magic, 4);
  put32(f + 4, VERSION);
  put64(f + 8, fr->seq);
  put64(f + 16, fr->first_offset);
  put64(f + 24, fr->bytes);
}

int wtx__tcp_frame_check(const uint8_t *f, const wtx__tcp_frame *want,
                         char *err, size_t errlen) {
  if (memcmp(f, frame_magic, 4) != 0) {
    snprintf(err, errlen, "frame header: no 'WTXC' magic (the stream is out of step)");
    return WTX_EPROTO;
  }
  if (get32(f + 4) != VERSION) {
    snprintf(err, errlen, "frame header: version %u, this worker speaks %d",
             get32(f + 4), VERSION);
    return WTX_EPROTO;
  }
  const struct {
    const char *field;
    uint64_t got, want;
  } fields[] = {
      {"chunk", get64(f + 8), want->seq},
      {"first_param_offset", get64(f + 16), want->first_offset},
      {"chunk_bytes", get64(f + 24), want->bytes},
  };
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
    if (fields[i].got != fields[i].want) {
      snprintf(err, errlen, "frame header: %s %llu, UpdateWeights announced %llu",
               fields[i].field, (unsigned long long)fields[i].got,
               (unsigned long long)fields[i].want);
      return WTX_EPROTO;
    }
  return 0;
}

void wtx__tcp_trailer_encode(uint8_t *h, uint64_t seq, uint32_t count) {
  memcpy(h, trailer_magic, 4);
  put32(h + 4, count);
  put64(h + 8, seq);
}

void wtx__tcp_trailer_put_sums(uint8_t *p, const uint64_t *sums, size_t count) {
  for (size_t i = 0; i < count; i++) put64(p + 8 * i, sums[i]);
}

int wtx__tcp_trailer_check(const uint8_t *h, uint64_t seq, uint32_t max, uint32_t *count,
                           char *err, size_t errlen) {
  if (memcmp(h, trailer_magic, 4) != 0) {
    snprintf(err, errlen, "checksum trailer: no 'WTXS' magic (the stream is out of step)");
    return WTX_EPROTO;
  }
  if (get64(h + 8) != seq) {
    snprintf(err, errlen, "checksum trailer: chunk %llu, expected %llu",
             (unsigned long long)get64(h + 8), (unsigned long long)seq);
    return WTX_EPROTO;
  }
  *count = get32(h + 4);
  if (*count > max) {
    snprintf(err, errlen, "checksum trailer: %u checksums, at most %u", *count, max);
    return WTX_EPROTO;
  }
  return 0;
}

void wtx__tcp_trailer_get_sums(const uint8_t *p, uint64_t *sums, size_t count) {
  for (size_t i = 0; i < count; i++) sums[i] = get64(p + 8 * i);
}
