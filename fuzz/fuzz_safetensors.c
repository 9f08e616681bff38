/* libFuzzer target: the safetensors parser (a file's whole content), as
 * --model-spec and the safetensors source read it. */
#include "common/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  wtx_st_file *f = NULL;
  char err[512];
  if (wtx_st_parse(data, size, "fuzz", &f, err, sizeof err) != 0) return 0;
  for (size_t i = 0; i < wtx_st_count(f); i++) {
    const wtx_st_tensor *t = wtx_st_tensor_at(f, i);
    volatile uint8_t sink = t->meta.nbytes > 0 ? t->data[t->meta.nbytes - 1] : 0;
    (void)sink; /* every tensor's bytes lie inside the input */
  }
  wtx_st_metadata(f, "format");
  wtx_st_close(f);
  return 0;
}
