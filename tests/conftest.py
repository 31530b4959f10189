import importlib
import importlib.metadata
import os
import sys

import pytest
import torch


def _bind_the_kernels_distribution() -> None:
    """The repository's kernels/ (installed as deepinfer.kernels) is also a top-level `kernels` package when the
    repository root is on sys.path (pytest run from it), and so shadows the `kernels` distribution (Hugging Face
    hub kernels) that transformers imports where it is installed: transformers' DeepSeek-V4 modules then fail to
    import, and the op-parity tests against them skipped instead of running. Bind the distribution's module
    first; nothing of ours imports the top-level name."""
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != root]
    try:
        sys.modules.pop("kernels", None)
        importlib.import_module("kernels")
    except Exception:  # noqa: BLE001 (a broken distribution: transformers' own import will say so)
        pass
    finally:
        sys.path[:] = saved


_bind_the_kernels_distribution()

# The tiny test models are dominated by per-op overhead; torch's intra-op thread pool only adds
# contention (a 16x64 GEMM takes ~8 us on one thread and can take >1 ms on two busy cores).
torch.set_num_threads(1)


# The fast tier (CI's 2 cores, < 12 minutes) keeps one or two cells of each large test matrix; the other cells,
# and a few long single tests whose property a faster fast-tier test also holds, run in the slow tier (marked here
# rather than in each file: one list to read). Entries: (file, a substring of the test id).
SLOW_CELLS = [
    ("test_tilelang_lowering", "sm_100a"),  # Blackwell lowering: the sm_90a cells stay in the fast tier
    ("test_tilelang_lowering_mhc.py", "premix_s4-"), ("test_tilelang_lowering_mhc.py", "premix_s64-"),
    ("test_tilelang_lowering_topk.py", "test_topk_kernel_as_compiled"),
    ("test_tilelang_lowering_attention_decode.py", "reads_a_ring_wider"),
    ("test_tilelang_lowering_linear.py", "machine_code"),
    ("test_llm_exactness.py", "tiny-engram-hc4"), ("test_llm_exactness.py", "tiny-swa-csa2-sync"),
    ("test_engine_exactness.py", "tiny-engram-hc4"), ("test_engine_exactness.py", "tiny-swa-csa2-async"),
    ("test_prefix_cache_exactness.py", "[embedded-greedy-async]"),
    ("test_prefix_cache_exactness.py", "[embedded-seeded"),
    ("test_prefix_cache_exactness.py", "[csa2-greedy"), ("test_prefix_cache_exactness.py", "[csa2-seeded-sync]"),
    ("test_prefix_cache_exactness.py", "[engram-greedy-sync]"), ("test_prefix_cache_exactness.py", "[engram-seeded"),
    ("test_determinism.py", "chunking[tiny-engram-hc4]"),
    ("test_structured_engine.py", "malformed_schema_in_one_batch[False]"),
    ("test_serving.py", "returns_valid_json[False]"),
    ("test_serving_api.py", "test_strict_schema_with_typeless_members"),
    ("test_yoco.py", "on_kept_rows[token-by-token]"),
    ("test_train_default_model.py", "test_smoke_loss_falls"),
    ("test_cli.py", "test_runs_after_a_non_editable_install"),
    ("test_vision_engine.py", "test_preemption_and_recompute_keep_the_image"),
    ("test_vision_engine.py", "test_an_image_request_runs_in_the_engine_core_process"),
    ("test_tilelang_lowering_topk.py", "test_topk_kernel_lowers_to_cuda"),
    ("test_tilelang_lowering_attention_decode.py", "lowers_to_cuda[3-"),
    ("test_determinism.py", "test_seeded_outputs_are_the_same_alone_in_any_batch_order"),
    ("test_train_default_model.py", "test_export_loads"),
    ("test_serving_load.py", "test_a_full_admission_queue_answers_429"),
    ("test_dspark.py", "test_greedy_with_preemption_equals_plain_decoding[False]"),
    ("test_cli.py", "test_multirun_writes_one_result_per_job"),
    ("test_yoco.py", "chunked_and_preempted[sampled]"),
    ("test_prefix_cache_exactness.py", "[engram-greedy-async]"),
    ("test_serving_api.py", "test_vllm_sampling_fields[chat]"),
    # the fast tier at 770 s on the 2-core VM (2026-12-02): the longest cells whose feature keeps a fast cell
    ("test_train_default_model.py", "test_export_is_in_the_released_storage_format"),
    ("test_serving.py", "test_strict_tool_call_round_trips"),
    ("test_structured_engine.py", "malformed_schema_in_one_batch[True]"),
    ("test_serving_load.py", "test_500_concurrent_streams_none_lost_cache_freed"),
    ("test_deepinfer_dropin_scripts.py", "test_a_deepinfer_script_with_its_dspark_variables_runs_unchanged"),
    ("test_tilelang_lowering_mhc.py", "premix_s16-"),
    ("test_reliability_grammar.py", "test_four_100k_value_enums_do_not_delay_a_regex_request"),
    ("test_dspark_bench.py", "test_a_controlled_run_on_the_cpu"),
    ("test_prefix_cache_exactness.py", "[csa2-seeded-async]"),
    ("test_prefix_cache_features.py", "dspark_drafting_with_prefix_hits_gives_the_tokens_and_logprobs_of_no_cache[seeded]"),
    ("test_prefix_cache_features.py", "yoco_with_prefix_hits_gives_the_tokens_and_logprobs_of_no_cache[mask]"),
    ("test_prefix_cache_features.py", "yoco_with_prefix_hits_gives_the_tokens_and_logprobs_of_no_cache[compact-dspark"),
    ("test_prefix_cache_features.py", "dspark_drafting_with_prefix_hits_gives_the_tokens_and_logprobs_of_no_cache[gr"),
    ("test_prefix_cache_features.py", "test_structured_outputs_with_prefix_hits"),
    ("test_prefix_cache_parallel.py", "[cp2]"), ("test_prefix_cache_parallel.py", "[dep2]"),  # multi-process
    ("test_heavy_grammar_memory.py", "rss_does_not_keep"),  # a subprocess core and eight heavy grammars
    # a fresh-clone fast tier at 792 s on the 2-core VM (2026-12-02, session 23): each keeps a fast cell of its matrix
    ("test_llm_exactness.py", "tiny-swa-csa2-async"), ("test_engine_exactness.py", "tiny-swa-csa2-sync"),
    ("test_vision_engine.py", "test_deepinfer_dropin_takes_multi_modal_data_in_its_form"),
    # a fresh-clone fast tier at 745 s / 710 s on the 2-core VM (2026-12-02, session 24): the module keeps its
    # other tokenizer and dummy-weight cells fast
    ("test_load_format_tokenizer.py", "test_a_copy_of_the_tokenizer_elsewhere_gives_the_same_output"),
    ("test_load_format_tokenizer.py", "test_dropin_dummy_on_a_directory_without_weights_generates"),
    ("test_cli.py", "test_runs_the_embedded_model_from_another_directory"), ("test_cli.py", "test_prompts_from_a_jsonl"),
    ("test_serving_faults.py", "test_accept_out_of_file_descriptors"),  # the soak's 2,000 idle connections too
    ("test_tilelang_lowering_attention_decode.py", "lowers_to_cuda[1-sm_90a]"),
    ("test_reliability_checkpoint.py", "test_a_nan_checkpoint_through_the_cli"),
    ("test_yoco.py", "test_engine_compact_with_dspark_drafting"),
    ("test_dspark.py", "test_sampled_tokens_with_drafts_follow_plain_sampling"),
    ("test_engine_process.py", "does_not_outlive_its_frontend[killed]"),
    # the fast tier at 763 s (fresh clone) / 797 s (a --durations run) on the 2-core machine (2026-12-07): the
    # training smoke run's ~20 s fixture with the last of its tests (the training-form ops tests stay fast), the
    # server-level dead-core check (the engine-level heartbeat and step-deadline tests stay fast), and cells with
    # fast siblings
    ("test_train_default_model.py", "test_the_engine_drafts_exactly_what_the_draft_layers_were_trained_as"),
    ("test_train_default_model.py", "test_every_draft_tensor_gets_a_gradient"),
    ("test_train_default_model.py", "test_tokenizer_has_the_chat_markers"),
    ("test_train_default_model.py", "test_training_is_deterministic_given_the_seed"),
    ("test_train_default_model.py", "test_every_trainable_tensor_gets_a_gradient_and_features_come_back"),
    ("test_train_default_model.py", "test_release_tensors_rejects_missing_and_unexpected_names"),
    ("test_serving_faults.py", "test_health_reports_a_stopped_core_and_a_dead_core"),
    ("test_dspark.py", "test_greedy_output_equals_plain_decoding[2-True-True]"),
    ("test_dspark.py", "test_structured_outputs_with_drafts_stay_valid_and_equal_plain"),
    ("test_vision_engine.py", "test_yoco_compact_and_dspark_keep_image_requests_exact"),
    ("test_tilelang_lowering_mhc.py", "mixes_fused_s64-"),
    ("test_tilelang_lowering_moe.py", "up_fp8_bt8_k128_s16"),
    ("test_load_format_tokenizer.py", "test_the_config_key_is_checked_and_the_cli_takes_it"),
    # the fast tier at 812 s on the 2-core machine (2026-12-07, a --durations run beside other work): the malformed
    # checkpoints' CLI subprocesses (~3.7 s each; a config and a tokenizer case stay fast), the WG1-rows candidate's
    # split lowering (its one-split cell stays fast)
    ("test_reliability_checkpoint.py", "exit_2[config-is-a-list]"),
    ("test_reliability_checkpoint.py", "exit_2[max_position_embeddings-0]"),
    ("test_reliability_checkpoint.py", "exit_2[num_hidden_layers--1]"),
    ("test_reliability_checkpoint.py", "exit_2[hc_sinkhorn_iters-1e9]"),
    ("test_reliability_checkpoint.py", "exit_2[rms_norm_eps-nan]"),
    ("test_reliability_checkpoint.py", "exit_2[rope_theta-negative]"),
    ("test_tilelang_lowering_attention_decode.py", "between_its_pvs[3]"),
    ("test_tilelang_lowering_attention_decode.py", "candidate_s_register_split"),
    # a fresh-clone fast tier at 750 s (2026-12-07): cells whose matrix keeps smaller fast cells
    ("test_moe_routing_table.py", "[400-6-384-20]"),
    ("test_determinism.py", "chunking[tiny-swa-csa2]"),
    # a fresh-clone fast tier at 724 s (2026-12-07, the machine otherwise idle): cells whose feature keeps a fast test
    # (the one-token greedy cell; the heartbeat-deadline report; the in-process drain)
    ("test_dspark.py", "test_greedy_output_equals_plain_decoding[5-True-False]"),
    ("test_reliability_engine.py", "test_a_stopped_core_is_reported_even_while_generate_is_waiting_for_tokens"),
    ("test_serving_lifecycle.py", "test_sigterm_drains_open_streams_then_exits_cleanly"),
    # the fast tier at 727 s (2026-12-07, fortieth session): the weight-streaming probe's and the bulk MoE passes'
    # ptxas cells beyond one of each (the probe's cp.async block path and tensor-copy path at 4 stages; the bulk
    # up pass at 8 tokens a chunk)
    ("test_tilelang_lowering_stream_probe.py", "[block-8]"), ("test_tilelang_lowering_stream_probe.py", "[warp-"),
    ("test_tilelang_lowering_stream_probe.py", "[rows-"), ("test_tilelang_lowering_stream_probe.py", "[tile-"),
    ("test_tilelang_lowering_stream_probe.py", "[tma2d-8]"), ("test_tilelang_lowering_moe_bulk.py", "[up-1-4]"),
    ("test_tilelang_lowering_moe_bulk.py", "[down-"),
    # a fresh-clone fast tier at 793 s (2026-12-07, forty-first session): end-to-end cells whose feature keeps a fast
    # test (the CLI's other runs, dep2's in-process cases, the engine's structured outputs, YOCO compact unchunked)
    ("test_cli.py", "test_cli_and_api_give_the_same_tokens_for_the_same_config"),
    ("test_parallel_engine.py", "test_dep2_from_the_cli_returns_the_tokens_of_single"),
    ("test_serving.py", "returns_valid_json[True]"),
    ("test_yoco.py", "chunked_and_preempted[greedy]"),
    # a fresh-clone fast tier at 718 s / 690 s (2026-12-07, forty-second session): cp2's multi-process run (the slow
    # tier holds the parallel runs), seeded DSpark in any batch (greedy DSpark's cells stay fast), lowering cells of
    # matrices that keep one fast cell
    ("test_context_parallel_engine.py", "test_cp2_returns_the_tokens_of_single_greedy_and_sampled"),
    ("test_dspark.py", "test_seeded_sampling_with_drafts_is_the_same_alone_and_in_any_batch"),
    ("test_tilelang_lowering_moe.py", "machine_code[up_fp8_bt8]"),
    ("test_tilelang_lowering_moe.py", "machine_code[up_fp4_bt16_bn128]"),
    ("test_tilelang_lowering_moe.py", "machine_code[up_fp4_bt8_k128]"),
    ("test_tilelang_lowering.py", "[indexer_fp4_tiles-sm_90a]"),
    ("test_tilelang_lowering.py", "[attn_dense_single-sm_90a]"),
    # then 709.6 s: more multi-process runs (dep2's rank death, EP's two-rank dispatch: their in-process siblings stay
    # fast) and cells whose feature keeps a fast one (the CLI's other user errors, an own recipe's run and bad value,
    # with_attrs.py's own run)
    ("test_parallel_rank_death.py", "test_dep2_rank_0_killed_is_reported_as_rank_0"),
    ("test_expert_parallel.py", "test_static_capacity_dispatch_two_ranks_equals_single_process"),
    ("test_cli.py", "test_user_errors_are_one_line_with_exit_code_2[args0-"),
    ("test_cli_config_dir.py", "test_a_sweep_over_an_own_recipe_is_checked_before_any_job_runs"),
    ("test_benchmark_with_attrs.py", "test_an_unknown_constant_or_a_malformed_override_is_one_line_and_exit_2"),
    # a fresh-clone fast tier at 727.6 s (2026-12-07, forty-third session; 669.7 s on the same tests the session
    # before): ~45 s of cells whose feature keeps a fast one (the engine-level core-death tests; the fused mixes'
    # finalize lowering; premix at 4+ splits; the decode kernel at 1 and 3 splits; vLLM's fields on chat; the
    # zeroing routing table; the FP4 indexer)
    ("test_reliability_cli.py", "test_an_engine_core_that_dies_under_the_cli_is_one_line_and_exit_2"),
    ("test_tilelang_lowering_mhc.py", "[mixes_fused_s1-"), ("test_tilelang_lowering_mhc.py", "[premix_s1-"),
    ("test_tilelang_lowering_attention_decode.py", "lowers_to_cuda[10-sm_90a]"),
    ("test_serving_api.py", "test_vllm_sampling_fields[completions]"),
    ("test_tilelang_lowering.py", "[moe_prep-sm_90a]"), ("test_tilelang_lowering.py", "[indexer_dense-sm_90a]"),
    # a fresh-clone fast tier at 663.1 s (2026-12-07, forty-fourth session; 707 s with --durations on the same
    # machine): ~30 s of the decode attention kernel's lowering cells (its one-split output test stays fast)
    ("test_tilelang_lowering_attention_decode.py", "block_loop_is_one_body[1-None]"),
    ("test_tilelang_lowering_attention_decode.py", "merge_in_distributed_shared_memory[2-None]"),
    ("test_tilelang_lowering_attention_decode.py", "between_its_pvs[1]"),
]  # the fast tier keeps one prefix-cache case beyond the chat's: YOCO compact with hits


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
    """Marks SLOW_CELLS slow; and the one GPU-skip hook: tests marked `gpu` (pyproject's markers) are skipped
    where CUDA is absent."""
    slow = pytest.mark.slow
    for item in items:
        name = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        if any(name.startswith(f) and part in item.nodeid for f, part in SLOW_CELLS):
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def server():
    """An HTTP server on the embedded model (16 sequences), one per test module that asks for it."""
    from serving_helpers import ThreadServer

    srv = ThreadServer(["engine.max_num_seqs=16"])
    yield srv
    srv.close()
