/* This rank's FSDP part of a source (fsdp.h). */
#include "client/fsdp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport/plan.h"

struct wtx__fsdp {
  size_t n;
  uint32_t *ranks;
  uint8_t **parts;
  wtx_memory_tensor *mem;
  wtx_ownership *own;
};

/* Placements naming each dim a part may split. */
static const int32_t DIMS[WTX_MAX_DIMS] = {0, 1, 2, 3, 4, 5, 6, 7};

void wtx__fsdp_free(wtx__fsdp *f) {
  if (f == NULL) return;
  for (size_t i = 0; f->parts != NULL && i < f->n; i++) free(f->parts[i]);
  free(f->parts);
  free(f->ranks);
  free(f->mem);
  free(f->own);
  free(f);
}

/* Copies rank's part of tensor m (its bytes at data) into f's slot i. */
static int copy_part(wtx__fsdp *f, size_t i, const wtx_tensor_meta *m, const uint8_t *data,
                     uint32_t rank, uint32_t world, uint32_t dim) {
  f->own[i] = (wtx_ownership){.owners = f->ranks, .n_owners = world,
                              .placements = m->ndim > 0 ? &DIMS[dim < m->ndim ? dim : 0] : NULL};
  wtx_box whole, part;
  wtx_box_whole(m, &whole);
  wtx_ownership_rank_box(m, &f->own[i], rank, &part);
  size_t es = wtx_dtype_size(m->dtype);
  uint64_t bytes = wtx_box_elements(&part) * es;
  f->mem[i] = (wtx_memory_tensor){m->name, m->dtype, m->shape, m->ndim, NULL, 0};
  if (bytes == 0) return 0;
  if ((f->parts[i] = malloc(bytes)) == NULL) return WTX_ENOMEM;
  wtx_box_copy(f->parts[i], NULL, data, &whole, &part, es);
  f->mem[i].data = f->parts[i];
  return 0;
}

int wtx__fsdp_part(wtx_source *full, uint32_t rank, uint32_t world, uint32_t dim,
                   wtx_source **out, wtx__fsdp **held, char *err, size_t errlen) {
  const wtx_tensor_meta *metas;
  size_t n;
  void *iter = NULL;
  *out = NULL;
  *held = NULL;
  int rc = wtx_source_metadata(full, &metas, &n);
  wtx__fsdp *f = rc == 0 ? calloc(1, sizeof *f) : NULL;
  if (rc == 0 && f == NULL) rc = WTX_ENOMEM;
  if (rc == 0) {
    f->n = n;
    f->ranks = malloc(world * sizeof *f->ranks);
    f->parts = calloc(n + 1, sizeof *f->parts);
    f->mem = calloc(n + 1, sizeof *f->mem);
    f->own = calloc(n + 1, sizeof *f->own);
    if (!f->ranks || !f->parts || !f->mem || !f->own) rc = WTX_ENOMEM;
  }
  for (uint32_t r = 0; rc == 0 && r < world; r++) f->ranks[r] = r;
  if (rc == 0) rc = wtx_source_open(full, &iter);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    wtx_tensor_meta m;
    const uint8_t *data;
    int r = wtx_source_next(full, iter, &m, &data);
    if (r <= 0) rc = r < 0 ? r : WTX_EPROTO; /* fewer tensors than its metadata */
    if (rc == 0) rc = copy_part(f, i, &metas[i], data, rank, world, dim);
  }
  if (iter != NULL) wtx_source_close(full, iter);
  if (rc == 0) rc = wtx_source_memory_owned(f->mem, f->own, n, rank, out, err, errlen);
  if (rc != 0) {
    if (err[0] == '\0') snprintf(err, errlen, "rank %u's part: %s", rank, wtx_strerror(rc));
    wtx__fsdp_free(f);
    return rc;
  }
  *held = f;
  return 0;
}
