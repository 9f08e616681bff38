/* wtx push --world N --rank R: this rank's FSDP part of a source, as FSDP2
 * shards a model: dim 0 of every tensor split over the N ranks as
 * torch.chunk splits (a scalar replicated), each rank holding only its
 * part; or another dim (--shard-dim), as a Megatron trainer's row-parallel
 * layers split dim 1 (a tensor of no such dim splits dim 0). So one process per rank, each given the same source, stands for a
 * sharded trainer (bench/many.sh, a smoke test of a cluster). CLI only. */
#ifndef WTX_CLIENT_FSDP_H
#define WTX_CLIENT_FSDP_H

#include <stddef.h>
#include <stdint.h>

#include "wtx/source.h"

typedef struct wtx__fsdp wtx__fsdp;

/* An owned memory source (*out, the caller's) over copies of rank's parts
 * of full's tensors, which *held owns (free with wtx__fsdp_free after
 * destroying *out); full stays the caller's and may go once this returns. */
int wtx__fsdp_part(wtx_source *full, uint32_t rank, uint32_t world, uint32_t dim,
                   wtx_source **out, wtx__fsdp **held, char *err, size_t errlen);
void wtx__fsdp_free(wtx__fsdp *f);

#endif /* WTX_CLIENT_FSDP_H */
