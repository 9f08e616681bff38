/* libFuzzer target: every WeightTransfer request message, decoded as the
 * worker decodes it and run through the checks the worker applies before
 * any byte moves (wire parameters, tensor metadata, text, the chunk's
 * shape against its tensors), fast and alone. The first input byte picks
 * the message. fuzz_session.c drives the real handlers with sequences. */
#include <stdlib.h>
#include <string.h>

#include "common/text.h"
#include "transport/rx.h"
#include "wtx/tensor.h"
#include "wtx/v1/weight_transfer.pb-c.h"

static const ProtobufCMessageDescriptor *const requests[] = {
    &wtx__v1__init_weight_transfer_engine_request__descriptor,
    &wtx__v1__start_weight_update_request__descriptor,
    &wtx__v1__update_weights_request__descriptor,
    &wtx__v1__prepare_weight_update_request__descriptor,
    &wtx__v1__finish_weight_update_request__descriptor,
    &wtx__v1__abort_weight_update_request__descriptor,
    &wtx__v1__update_weight_version_request__descriptor,
    &wtx__v1__get_weight_info_request__descriptor,
    &wtx__v1__get_world_size_request__descriptor,
    &wtx__v1__pause_request__descriptor,
    &wtx__v1__resume_request__descriptor,
};

static void check_init(const Wtx__V1__InitInfo *ii) {
  wtx_wire_params w;
  char err[512];
  wtx_wire_params_from_init(ii, WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE, &w,
                            err, sizeof err);
  wtx_init_case_name(ii->backend_case);
}

/* The session's checks of one chunk: every tensor, then the assembler's
 * view of the chunk's extent. */
static void check_chunk(const Wtx__V1__UpdateInfo *ui) {
  if (ui->n_params == 0 || ui->n_params > WTX_MAX_CHUNK_PARAMS) return;
  wtx_rx_tensor *rt = calloc(ui->n_params, sizeof *rt);
  wtx_tensor_meta *m = calloc(ui->n_params, sizeof *m);
  char err[1500];
  size_t ok = 0;
  for (size_t i = 0; rt && m && i < ui->n_params; i++, ok++) {
    const Wtx__V1__ParamMeta *pm = ui->params[i];
    if (wtx_tensor_meta_set(&m[i], pm->name, pm->dtype, pm->shape, pm->n_shape, err,
                            sizeof err) != 0 ||
        !wtx__utf8_valid(pm->name))
      break;
    rt[i] = (wtx_rx_tensor){m[i].name, m[i].nbytes, NULL};
  }
  wtx_rx *rx = NULL;
  if (ok == ui->n_params && wtx__rx_create(&rx) == 0) {
    if (wtx__rx_begin(rx, rt, ok, ui->first_param_offset, ui->chunk_bytes, 1) == 0) {
      wtx__rx_expect_checksums(rx, ui->xxh3_64, ui->n_xxh3_64);
      wtx__rx_end(rx); /* no byte came: an error, never a crash */
    }
    wtx__rx_destroy(rx);
  }
  free(rt);
  free(m);
}

static void check(const ProtobufCMessage *msg) {
  const ProtobufCMessageDescriptor *d = msg->descriptor;
  if (d == &wtx__v1__init_weight_transfer_engine_request__descriptor) {
    const Wtx__V1__InitWeightTransferEngineRequest *r = (const void *)msg;
    if (r->init_info != NULL) check_init(r->init_info);
  } else if (d == &wtx__v1__update_weights_request__descriptor) {
    const Wtx__V1__UpdateWeightsRequest *r = (const void *)msg;
    if (r->update_info != NULL) check_chunk(r->update_info);
  } else if (d == &wtx__v1__finish_weight_update_request__descriptor) {
    wtx__utf8_valid(((const Wtx__V1__FinishWeightUpdateRequest *)msg)->weight_version);
  } else if (d == &wtx__v1__prepare_weight_update_request__descriptor) {
    wtx__utf8_valid(((const Wtx__V1__PrepareWeightUpdateRequest *)msg)->weight_version);
  } else if (d == &wtx__v1__update_weight_version_request__descriptor) {
    wtx__utf8_valid(((const Wtx__V1__UpdateWeightVersionRequest *)msg)->weight_version);
  } else if (d == &wtx__v1__abort_weight_update_request__descriptor) {
    wtx__utf8_valid(((const Wtx__V1__AbortWeightUpdateRequest *)msg)->reason);
  }
  /* The worker's NUL check: the re-encoded size. */
  protobuf_c_message_get_packed_size(msg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  const ProtobufCMessageDescriptor *d = requests[data[0] % (sizeof requests / sizeof *requests)];
  ProtobufCMessage *msg = protobuf_c_message_unpack(d, NULL, size - 1, data + 1);
  if (msg == NULL) return 0;
  check(msg);
  protobuf_c_message_free_unpacked(msg, NULL);
  return 0;
}
