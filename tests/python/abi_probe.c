/* Sizes and field offsets of the public structs, as the compiler lays them
 * out, in JSON: the Python package's ctypes mirrors (python/src/wtx/_capi.py)
 * must agree, field by field (package_test.py). */
#include <stddef.h>
#include <stdio.h>

#include "wtx/client.h"
#include "wtx/source.h"
#include "wtx/worker.h"

#define F(T, f) printf("%s\"%s\": %zu", first++ ? ", " : "", #f, offsetof(T, f))
#define BEGIN(T) first = 0; printf("%s\"%s\": {\"size\": %zu, \"fields\": {", n++ ? ", " : "", #T, sizeof(T))
#define END() printf("}}")

int main(void) {
  int n = 0, first = 0;
  printf("{");
  BEGIN(wtx_tensor_meta); F(wtx_tensor_meta, name); F(wtx_tensor_meta, dtype);
  F(wtx_tensor_meta, shape); F(wtx_tensor_meta, ndim); F(wtx_tensor_meta, nbytes); END();
  BEGIN(wtx_client_options); F(wtx_client_options, timeout_ms); F(wtx_client_options, retries);
  F(wtx_client_options, token); F(wtx_client_options, tls_ca_pem);
  F(wtx_client_options, tls_cert_pem); F(wtx_client_options, tls_key_pem); END();
  BEGIN(wtx_trainer_config); F(wtx_trainer_config, rank); F(wtx_trainer_config, backend);
  F(wtx_trainer_config, unpacked); F(wtx_trainer_config, buffer_size);
  F(wtx_trainer_config, num_buffers); F(wtx_trainer_config, checksum);
  F(wtx_trainer_config, timeout_ms); F(wtx_trainer_config, data_address);
  F(wtx_trainer_config, direct); F(wtx_trainer_config, world);
  F(wtx_trainer_config, rank_addresses); F(wtx_trainer_config, session_token);
  F(wtx_trainer_config, delta); END();
  BEGIN(wtx_send_options); F(wtx_send_options, version); F(wtx_send_options, target);
  F(wtx_send_options, progress); F(wtx_send_options, progress_arg); END();
  BEGIN(wtx_send_result); F(wtx_send_result, bytes); F(wtx_send_result, params);
  F(wtx_send_result, chunks); F(wtx_send_result, seconds); F(wtx_send_result, version);
  F(wtx_send_result, xxh3); F(wtx_send_result, direct); F(wtx_send_result, control_bytes);
  F(wtx_send_result, delta); F(wtx_send_result, skipped_params);
  F(wtx_send_result, skipped_bytes); F(wtx_send_result, full_reason);
  F(wtx_send_result, patched_params); F(wtx_send_result, patched_whole_bytes); END();
  BEGIN(wtx_patch); F(wtx_patch, name); F(wtx_patch, dtype); F(wtx_patch, shape);
  F(wtx_patch, ndim); F(wtx_patch, index_dtype); F(wtx_patch, count); F(wtx_patch, indices);
  F(wtx_patch, values); END();
  BEGIN(wtx_ownership); F(wtx_ownership, owners); F(wtx_ownership, n_owners);
  F(wtx_ownership, mesh_shape); F(wtx_ownership, mesh_ndim); F(wtx_ownership, placements);
  END();
  BEGIN(wtx_source_ops); F(wtx_source_ops, version); F(wtx_source_ops, name);
  F(wtx_source_ops, metadata);
  F(wtx_source_ops, open); F(wtx_source_ops, next); F(wtx_source_ops, close);
  F(wtx_source_ops, destroy); F(wtx_source_ops, next_batch); F(wtx_source_ops, ownership);
  END();
  BEGIN(wtx_model_ops); F(wtx_model_ops, version); F(wtx_model_ops, check);
  F(wtx_model_ops, begin); F(wtx_model_ops, stage);
  F(wtx_model_ops, loaded); F(wtx_model_ops, prepare); F(wtx_model_ops, commit);
  F(wtx_model_ops, abort); F(wtx_model_ops, stage_device);
  F(wtx_model_ops, adopt_device); F(wtx_model_ops, check_chunk);
  F(wtx_model_ops, stage_chunk); F(wtx_model_ops, loaded_chunk);
  F(wtx_model_ops, check_range); F(wtx_model_ops, revert); F(wtx_model_ops, read); END();
  BEGIN(wtx_control_ops); F(wtx_control_ops, version); F(wtx_control_ops, init); F(wtx_control_ops, start);
  F(wtx_control_ops, update); F(wtx_control_ops, finish); F(wtx_control_ops, abort);
  F(wtx_control_ops, patches); END();
  BEGIN(wtx_worker_options); F(wtx_worker_options, listen); F(wtx_worker_options, backends);
  F(wtx_worker_options, n_backends); F(wtx_worker_options, model_ops);
  F(wtx_worker_options, model); F(wtx_worker_options, world_size);
  F(wtx_worker_options, watchdog_ms); F(wtx_worker_options, max_message_bytes);
  F(wtx_worker_options, on_pause); F(wtx_worker_options, on_resume); F(wtx_worker_options, host);
  F(wtx_worker_options, model_spec); F(wtx_worker_options, publish_dir);
  F(wtx_worker_options, publish_keep); F(wtx_worker_options, token_file);
  F(wtx_worker_options, tls_cert_pem); F(wtx_worker_options, tls_key_pem);
  F(wtx_worker_options, tls_client_ca_pem); F(wtx_worker_options, reflection);
  F(wtx_worker_options, max_calls); F(wtx_worker_options, max_model_bytes);
  F(wtx_worker_options, max_params); F(wtx_worker_options, allow_upstream);
  F(wtx_worker_options, vllm_url); F(wtx_worker_options, vllm_dir);
  F(wtx_worker_options, vllm_pause_mode); F(wtx_worker_options, vllm_disk);
  F(wtx_worker_options, vllm_timeout_ms); F(wtx_worker_options, metrics_listen);
  F(wtx_worker_options, relay_port);
  F(wtx_worker_options, cuda_device); F(wtx_worker_options, shard_rules);
  F(wtx_worker_options, tp_rank); F(wtx_worker_options, tp_size); END();
  printf("}\n");
  return 0;
}
