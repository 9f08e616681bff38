/* The tcp backend's two wire records (docs/data-plane.md, "tcp"), as pure
 * functions so they are tested on their own:
 *  - the hello every data connection opens with: "WTXH", version, token
 *    length, the session's data_token (zero-padded to WTX__TCP_TOKEN_MAX);
 *  - with several senders (TcpInitInfo.sender_addresses), after the hello
 *    on each sender's connection: "WTXW", the worker's index (4 bytes),
 *    rank 0's plan digest (8); the sender answers "WTXP", 4 zero bytes,
 *    its own plan digest (8). Rank 0 checks every other rank the same
 *    way at init, as worker index WTX__TCP_WHO_RANK0; where the digests
 *    differ it then sends its parameters' digests (a trailer record of
 *    sequence 0), and the rank answers "WTXD", the length of a text (4),
 *    the index of the first parameter that differs (8), then the text:
 *    that parameter as the rank sees it. Where the rank asked for it, the
 *    check's connection stays open as rank 0's link, and each sync starts
 *    with a go record on it: "WTXG", a payload's length (4), the session
 *    generation (8), then the payload (nccl: the communicator's id); a
 *    delta sync's exchange follows on it: "WTXX", the record's kind (4),
 *    its payload's length (8), then the payload;
 *  - the 32-byte frame header before each chunk: "WTXC", version, chunk
 *    sequence, first_param_offset, chunk_bytes;
 *  - with TcpInitInfo.checksum_trailer, the trailer after each chunk's
 *    bytes: "WTXS", count, chunk sequence (16 bytes), then count XXH3-64
 *    values of 8 bytes, one per tensor ending in the chunk.
 * Integers are little-endian. Internal to transport/. */
#ifndef WTX_TRANSPORT_TCP_FRAME_H
#define WTX_TRANSPORT_TCP_FRAME_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define WTX__TCP_TOKEN_MIN 16
#define WTX__TCP_TOKEN_MAX 64
#define WTX__TCP_HELLO_BYTES (12 + WTX__TCP_TOKEN_MAX)
#define WTX__TCP_FRAME_BYTES 32
#define WTX__TCP_TRAILER_HEAD_BYTES 16
#define WTX__TCP_WHO_BYTES 16
#define WTX__TCP_PLAN_BYTES 16
#define WTX__TCP_DIFF_BYTES 16
/* The who record's index when rank 0, not a worker, checks a rank's plan. */
#define WTX__TCP_WHO_RANK0 UINT32_MAX
/* The longest text a diff record carries. */
#define WTX__TCP_DIFF_TEXT_MAX 1024

/* What a frame header says of the chunk that follows it. */
typedef struct wtx__tcp_frame {
  uint64_t seq;          /* chunks of the session before this one */
  uint64_t first_offset; /* UpdateInfo.first_param_offset */
  uint64_t bytes;        /* UpdateInfo.chunk_bytes */
} wtx__tcp_frame;

/* h: WTX__TCP_HELLO_BYTES. len: 1..WTX__TCP_TOKEN_MAX. */
void wtx__tcp_hello_encode(uint8_t *h, const uint8_t *token, size_t len);
/* 0 when h is a hello of this version carrying exactly token, else
 * WTX_EAUTH (a peer that is not ours: nothing of it is echoed). */
int wtx__tcp_hello_check(const uint8_t *h, const uint8_t *token, size_t len);

/* w: WTX__TCP_WHO_BYTES. */
void wtx__tcp_who_encode(uint8_t *w, uint32_t index, uint64_t digest);
/* A "WTXW" record's worker index and plan digest: WTX_EPROTO when it is
 * not one. */
int wtx__tcp_who_decode(const uint8_t *w, uint32_t *index, uint64_t *digest);
/* p: WTX__TCP_PLAN_BYTES, a sender's answer to the who record. */
void wtx__tcp_plan_encode(uint8_t *p, uint64_t digest);
int wtx__tcp_plan_decode(const uint8_t *p, uint64_t *digest);

/* d: WTX__TCP_DIFF_BYTES, a rank's answer to rank 0's parameter digests:
 * the first index that differs and the length of the text after it. */
void wtx__tcp_diff_encode(uint8_t *d, uint64_t index, uint32_t text_len);
/* WTX_EPROTO when d is not one, or its text is over WTX__TCP_DIFF_TEXT_MAX. */
int wtx__tcp_diff_decode(const uint8_t *d, uint64_t *index, uint32_t *text_len);

/* r: WTX__TCP_RING_BYTES, then the ring's name (name_len bytes, at most
 * 255): a worker's shared-memory ring for one sender (TcpInitInfo.
 * shm_ring; "WTXR"), or with region its receive region in shared memory,
 * cap bytes (TcpInitInfo.shm_region_bytes; "WTXM"). The sender answers
 * one byte, 'A', once it opened it. */
#define WTX__TCP_RING_BYTES 16
void wtx__tcp_ring_encode(uint8_t *r, uint64_t cap, uint32_t name_len, int region);
/* WTX_EPROTO when r is neither, or its name is empty or over 255;
 * *region says which. */
int wtx__tcp_ring_decode(const uint8_t *r, uint64_t *cap, uint32_t *name_len, int *region);

/* A worker's receive region for a sender (TcpInitInfo.cuda_region_bytes):
 * "WTXI", then its record (ipc_region.h); the sender answers one byte,
 * 'A', once it opened it. */
#define WTX__TCP_REGION_MAGIC "WTXI"

#define WTX__TCP_GO_BYTES 16
#define WTX__TCP_GO_PAYLOAD_MAX 1024
/* g: WTX__TCP_GO_BYTES, then payload_len bytes of payload. */
void wtx__tcp_go_encode(uint8_t *g, uint64_t generation, uint32_t payload_len);
/* WTX_EPROTO when g is not one, or its payload is over WTX__TCP_GO_PAYLOAD_MAX. */
int wtx__tcp_go_decode(const uint8_t *g, uint64_t *generation, uint32_t *payload_len);

/* A delta sync's exchange on rank 0's link to another rank (client/many.c):
 * d: WTX__TCP_DELTA_BYTES ("WTXX", the record's kind, its payload's
 * length), then the payload. Rank 0 asks (WTX__TCP_ASK_BYTES), the rank
 * answers what it changed, rank 0 tells it the sync's decision. */
#define WTX__TCP_DELTA_BYTES 16
#define WTX__TCP_DELTA_PAYLOAD_MAX (UINT64_C(1) << 30)
enum { WTX__TCP_DELTA_ASK = 1, WTX__TCP_DELTA_ANSWER = 2, WTX__TCP_DELTA_DECISION = 3 };
void wtx__tcp_delta_encode(uint8_t *d, uint32_t kind, uint64_t len);
/* WTX_EPROTO when d is not a record of kind, or its payload is over the
 * maximum. */
int wtx__tcp_delta_decode(const uint8_t *d, uint32_t kind, uint64_t *len);

/* A delta's patch records, after the bits of an answer (a rank's offers)
 * or of a decision (the offers taken): per piece of the plan sent as a
 * patch, its index (4), 4 zero bytes, the patch's element count (8) and
 * the XXH3-64 of the piece once patched (8). */
#define WTX__TCP_PATCH_BYTES 24
void wtx__tcp_patch_encode(uint8_t *rec, uint32_t piece, uint64_t count, uint64_t result);
/* WTX_EPROTO when the zero bytes are not, or count is 0. */
int wtx__tcp_patch_decode(const uint8_t *rec, uint32_t *piece, uint64_t *count,
                          uint64_t *result);

/* Rank 0's ask, the payload of WTX__TCP_DELTA_ASK: its flags (1 byte,
 * client/many.c's ASK_*), 7 zero bytes, then this sync's number and the
 * number of the last sync that landed on every worker (0: none), 8 bytes
 * each. A rank takes what it hashed for a sync as what the workers hold
 * only when that sync is the one that landed: a failed sync's ask may
 * never have reached it. */
#define WTX__TCP_ASK_BYTES 24
void wtx__tcp_ask_encode(uint8_t *rec, uint8_t flags, uint64_t seq, uint64_t landed);
/* WTX_EPROTO when the zero bytes are not, seq is 0, or landed is not
 * before seq. */
int wtx__tcp_ask_decode(const uint8_t *rec, uint8_t *flags, uint64_t *seq, uint64_t *landed);

/* f: WTX__TCP_FRAME_BYTES. */
void wtx__tcp_frame_encode(uint8_t *f, const wtx__tcp_frame *fr);
/* Checks a received header against the chunk UpdateWeights announced
 * (want): WTX_EPROTO naming the first field that differs (magic, version,
 * chunk sequence, offset, bytes) in err, with both values. */
int wtx__tcp_frame_check(const uint8_t *f, const wtx__tcp_frame *want,
                         char *err, size_t errlen);

/* h: WTX__TCP_TRAILER_HEAD_BYTES, followed by count values that
 * wtx__tcp_trailer_put_sums writes. */
void wtx__tcp_trailer_encode(uint8_t *h, uint64_t seq, uint32_t count);
void wtx__tcp_trailer_put_sums(uint8_t *p, const uint64_t *sums, size_t count);
/* Checks a received trailer head against chunk seq: WTX_EPROTO naming
 * the field in err (magic, chunk sequence, a count above max), else 0 and
 * *count. */
int wtx__tcp_trailer_check(const uint8_t *h, uint64_t seq, uint32_t max, uint32_t *count,
                           char *err, size_t errlen);
void wtx__tcp_trailer_get_sums(const uint8_t *p, uint64_t *sums, size_t count);

#ifdef __cplusplus
}
#endif
#endif /* WTX_TRANSPORT_TCP_FRAME_H */
