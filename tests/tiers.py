"""The multi-rank tests the default run (`pytest -q`) keeps: one or two per feature family.

Every test marked `slow` (it spawns ranks or runs a whole job) that is not named here gets
the `extended` marker and leaves the default run; `pytest -m extended` runs them, and
`pytest -m "slow or zoo"` with `-p no:cacheprovider` everything multi-rank. The default run
must stay under 20 minutes on a quiet 2-core machine (README, "Test tiers"): add a test
here only in place of another of its family, and measure (THREEFOLD_TEST_TIMES=FILE
records each test's wall and CPU seconds).

An entry is a test id as pytest prints it, with or without its [parameters] (without: every
case of it).
"""

DEFAULT_SAMPLE = [
    # runtime: pipeline and data parallelism, schedules, the API
    "tests/test_runtime_parity.py::test_pipeline_and_data_parallel_match_single_process[2-plans0]",
    "tests/test_runtime_parity.py::test_pipeline_and_data_parallel_match_single_process[4-plans1]",
    "tests/test_runtime_parity.py::test_inflight_activations_respect_1f1b_bound",
    "tests/test_runtime_parity.py::test_hf_models_pipeline_parity[llama-kwargs1]",
    "tests/test_runtime_api.py::test_decorator_builds_a_parallel_module_and_evaluate_is_forward_only",
    "tests/test_runtime_api.py::test_train_main_job_runs_and_writes_its_loss_curve",
    # (test_plan_defaults' 4-rank dp/m inference left for compile=inductor: its rule is unit-tested)
    "tests/test_compiled_backend.py::test_inductor_chunks_match_single_process_under_tp_and_pp",
    "tests/test_forward_outputs.py::test_call_on_a_loss_compiled_model_equals_eager[tp=2,pp=2,m=2-4]",
    "tests/test_zero_bubble_parity.py::test_zero_bubble_pp2_matches_single_process",
    "tests/test_plan_fuzz.py::test_random_plans_match_single_process[gpt]",
    # tensor parallelism and sequence parallelism
    "tests/test_tensor_parallel.py::test_tensor_parallel_matches_single_process[gpt-2]",
    "tests/test_tensor_parallel.py::test_tensor_parallel_matches_single_process[llama-4]",
    "tests/test_tensor_parallel.py::test_vocabulary_that_tp_does_not_divide_is_padded_without_changing_the_loss",
    "tests/test_tp_constructs.py::test_an_einsum_weight_kept_whole_under_sp_trains_exactly",
    "tests/test_cp_recurrence.py::test_loops_match_one_process[2]",
    "tests/test_cp_lightning.py::test_decayed_linear_attention_matches_one_process[2]",
    "tests/test_tensor_parallel.py::test_other_decoder_architectures_match_single_process[gpt_neox]",
    "tests/test_tp_constructs.py::test_every_construct_matches_single_process_under_tp2",
    "tests/test_saved_shards.py::test_sequence_parallel_saves_shards_and_gathers_again_in_backward[gpt]",
    # semantics: losses, randomness, gradient norms
    "tests/test_semantics_parity.py::test_semantics_parity_two_ranks",
    "tests/test_semantics_rng.py::test_masks_independent_across_stages_microbatches_and_dp_agree_across_tp",
    "tests/test_grad_norm.py::test_grad_norm_parity_two_ranks",
    "tests/test_dp_sync.py::test_masked_mean_and_norm_without_their_all_reduces",
    "tests/test_own_loss.py::test_hf_labels_loss_matches_one_process_under_pp_tp_dp_and_ep",
    # memory: recompute, precision, ZeRO 1-3, HSDP, the memory model
    "tests/test_recompute_parity.py::test_recompute_matches_none_and_single_process[gpt-kwargs0]",
    "tests/test_precision.py::test_zero1_matches_single_process_optimizer_dp2[adamw]",
    "tests/test_precision.py::test_bf16_matches_single_process_autocast_within_rounding_noise",
    "tests/test_precision.py::test_fp16_skips_overflowing_steps_on_every_rank_and_backs_off",
    "tests/test_fsdp.py::test_zero2_zero3_hsdp_match_one_process",
    "tests/test_fsdp.py::test_sharded_bytes_per_parameter_match_the_formulas_and_the_estimate[2]",
    "tests/test_memory_model.py::test_saved_bytes_match_autograd_every_mode",
    # weights and checkpoints
    "tests/test_checkpoint_reshard.py::test_checkpoint_reshards_across_plans",
    "tests/test_checkpoint_agree.py::test_unseeded_ranks_train_rank0_weights_under_dp_and_tp",
    "tests/test_checkpoint_weights.py::test_tp2_from_a_sharded_hf_directory_matches_single_process",
    "tests/test_train_weights.py::test_spec_trains_from_the_weights_file_under_tp2",
    # artifacts, the main job, traces and the report
    "tests/test_artifact_run.py::test_threefold_run_trains_a_saved_artifact_like_the_original",
    "tests/test_train_cli.py::test_spec_batches_train_under_dp_with_metrics_sample_and_generate",
    "tests/test_trace_runs.py::test_traced_steps_follow_the_schedule[pp=2,m=4,schedule=zbv]",
    "tests/test_trace_runs.py::test_train_trace_writes_trace_and_summary",
    "tests/test_report_browser.py::test_inspect_report_opens_without_errors_and_searches",
    # faults and safety
    "tests/test_failure_report.py::test_the_launcher_reports_the_failing_ranks_traceback_once",
    "tests/test_rank_failure.py::test_dead_rank_makes_the_others_fail_naming_it",
    "tests/test_elastic_restart.py::test_a_killed_rank_restarts_on_the_same_world_bit_for_bit",
    # pipeline messages through shared memory: the channel, pp=4 and dp on vs off, the fallback
    "tests/test_local_p2p.py::test_channel_order_wraparound_and_timeout",
    "tests/test_local_p2p.py::test_pp4_interleaved_and_dp_on_off_and_one_process",
    "tests/test_local_p2p.py::test_other_host_and_oversized_messages_fall_back_to_gloo",
    "tests/test_safety_api.py::test_parallelize_joins_a_torchrun_job_by_itself",
    "tests/test_safety_bad_input.py::test_bad_weights_found_on_the_ranks_are_still_one_line_and_quick",
    "tests/test_safety_faults.py::test_a_dead_or_stopped_rank_ends_the_job_in_bounded_time[SIGKILL-0]",
    "tests/test_safety_faults.py::test_a_killed_launcher_takes_its_ranks_with_it[SIGKILL]",
    "tests/test_docs.py::test_docs_page_runs[README.md]",
    "tests/test_safety_files.py::test_train_resume_refuses_a_checkpoint_that_would_run_code",
    "tests/test_safety_files.py::test_a_foreign_process_writing_the_store_at_start_up_is_ignored",
    # rows of the batch: once-per-step buffers
    "tests/test_batch_coupling.py::test_step_counter_is_exact_under_pp_and_dp",
    # the last mile: HF caches, eager losses (CTC), uneven sp shards, complex/repeat/copy_ rules
    "tests/test_last_mile.py::test_last_mile_cells_match_single_process",
    # expert parallelism
    "tests/test_expert_parallel.py::test_ep2_trains_like_one_process_with_half_the_experts_per_rank",
    "tests/test_ep_fsdp.py::test_ep2_zero2_zero3_train_like_one_process_with_sharded_bytes",
    "tests/test_ep_modules.py::test_dp2_ep2_module_experts_train_like_one_process_each_rank_holding_half",
    # batch dims when sizes coincide (batch == seq / heads); autocast regions and ep's weight
    # views run multi-rank in the extended tier (their graph rules are unit-tested here)
    "tests/test_batch_dims_flow.py::test_coinciding_sizes_train_like_one_process_under_dp_and_pp",
    # context parallelism: ring attention with masks and position biases, the all-gather
    # fallback, factories along the sequence (cp=2)
    "tests/test_cp_masks.py::test_masked_attention_cp2_matches_one_process",
    "tests/test_cp_fallback.py::test_fallback_cp2_matches_one_process",
    "tests/test_cp_scans.py::test_scan_seq_equals_torch_on_the_whole_sequence[2]",
    "tests/test_group_reuse.py::test_building_the_groups_again_reuses_them",
    "tests/test_cp_rules.py::test_sequence_ops_cp2_match_one_process",
    "tests/test_cp_attention_bias.py::test_t5_style_relative_bias_cp2_matches_one_process",
    "tests/test_cp_factories.py::test_factories_at_cp2_match_one_process_losses_and_grads",
    "tests/test_cp_free_whole.py::test_packed_sequence_check_matches_one_process[2]",
    "tests/test_cp_uneven.py::test_gpt_on_7_tokens_matches_one_process_under_cp2",
    "tests/test_cp_pad_whole.py::test_small_whole_values_on_7_tokens_match_one_process_under_cp2",
    "tests/test_cp_birth.py::test_vits_born_inside_match_one_process[cp=2]",
    # the zoo's representative sample (the full matrices are `-m zoo`)
    "tests/test_zoo.py::test_zoo_sample_matches_single_process[llama-tp=2]",
    "tests/test_zoo.py::test_zoo_sample_matches_single_process[hw_nanogpt-pp=2,m=2]",
    "tests/test_zoo.py::test_zoo_sample_matches_single_process[nn_encoder_seq_first-tp=2]",
    "tests/test_zoo.py::test_zoo_sample_matches_single_process[hw_batchnorm-pp=2,m=2]",
]


# Single-process tests that take the most CPU (about 3-11 s each, measured): `slow` as well,
# so the quick tier (`-m "not slow"`) stays under 3 minutes, and in the default run all the
# same (they are counted in the sample).
LONG_SINGLE_PROCESS = [
    "tests/test_docs.py::test_the_site_builds_in_strict_mode",
    "tests/test_planner.py::test_tp_stays_within_a_node",
    "tests/test_foundation_split.py::test_chunks_in_order_reproduce_loss_and_every_gradient[llama]",
    "tests/test_bench_gpu_1b.py::test_gpu_1b_smoke_runs_threefold_and_eager_on_the_same_model",
    "tests/test_recompute.py::test_measured_saved_bytes_per_layer_full_below_selective_below_none",
    "tests/test_schedule.py::test_verifier_accepts_every_generated_schedule[8]",
    "tests/test_foundation_split.py::test_chunks_in_order_reproduce_loss_and_every_gradient[gpt2]",
    "tests/test_planner.py::test_table1_best_plan_fits_and_is_at_least_as_fast[529.6B]",
    "tests/test_schedule.py::test_verifier_accepts_every_generated_schedule[7]",
    "tests/test_planner.py::test_table1_best_plan_fits_and_is_at_least_as_fast[310.1B]",
    "tests/test_foundation_split.py::test_uneven_layers_30_on_pp4",
    "tests/test_planner.py::test_compiler_and_runtime_import_nothing_from_the_planner",
    "tests/test_checkpoint_resume.py::test_resume_from_a_directory_that_is_not_a_checkpoint_is_one_line",
    "tests/test_schedule.py::test_verifier_accepts_every_generated_schedule[6]",
    "tests/test_foundation_split.py::test_chunks_in_order_reproduce_loss_and_every_gradient[gpt]",
    "tests/test_planner.py::test_pipeline_only_as_needed_and_data_parallel_takes_the_rest",
    "tests/test_semantics_compile.py::test_loss_form_combines_exactly_in_one_process",
    "tests/test_planner.py::test_training_reads_no_compiler_ir",
    "tests/test_recompute.py::test_dropout_recomputed_in_backward_draws_the_forward_mask[full]",
    "tests/test_foundation_codegen.py::test_artifact_reloads_in_a_fresh_process[pp=3]",
    "tests/test_recompute.py::test_dropout_recomputed_in_backward_draws_the_forward_mask[selective]",
    "tests/test_schedule.py::test_verifier_accepts_every_generated_schedule[5]",
    "tests/test_recompute.py::test_full_is_one_segment_per_layer_and_selective_the_attention_core[llama-kwargs1-model.model.layers.{}]",
    "tests/test_artifact_run.py::test_run_rejects_a_directory_that_is_not_an_artifact",
    "tests/test_foundation_split.py::test_balance_24_layer_gpt_medium_pp8",
    "tests/test_runtime_api.py::test_check_command_bad_plan_is_exit_2",
    "tests/test_backward_split.py::test_generated_code_defers_every_parameter_read_by_an_op",
    "tests/test_runtime_api.py::test_runtime_imports_nothing_from_the_compiler",
    "tests/test_foundation_codegen.py::test_artifact_reloads_in_a_fresh_process[pp=2,v=2,schedule=interleaved]",
    "tests/test_schedule.py::test_verifier_accepts_every_generated_schedule[4]",
    "tests/test_planner.py::test_table1_best_plan_fits_and_is_at_least_as_fast[1008.0B]",
    "tests/test_planner_moe.py::test_a_traced_moe_spec_is_priced_as_moe_and_the_search_includes_ep_with_zero",
    "tests/test_planner_shapes.py::test_a100_matmul_fraction_is_the_least_squares_fit_to_the_measured_runs",
    "tests/test_ep_capacity.py::test_capacity_under_ep_without_microbatch_mean_is_a_one_line_plan_error",
]


def is_long_single_process(nodeid: str) -> bool:
    return nodeid in _LONG


def in_default_sample(nodeid: str) -> bool:
    return nodeid in _SAMPLE or nodeid.split("[", 1)[0] in _SAMPLE


def unmatched(collected_ids: list[str]) -> list[str]:
    """Sample entries of a collected file that name no collected test (a renamed test would
    otherwise leave the default run silently)."""
    files = {i.split("::", 1)[0] for i in collected_ids}
    bare = {i.split("[", 1)[0] for i in collected_ids}
    return [e for e in DEFAULT_SAMPLE + LONG_SINGLE_PROCESS
            if e.split("::", 1)[0] in files and e not in collected_ids and e not in bare]


_LONG = frozenset(LONG_SINGLE_PROCESS)
_SAMPLE = frozenset(DEFAULT_SAMPLE) | _LONG
