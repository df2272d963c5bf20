#!/usr/bin/env bash
# One call on the GPU machine for the device tests and benchmarks, in priority order,
# each step with its own time limit so a slow one cannot starve the rest. Logs and result JSON
# land in $OUT (at most 8 files come back); copy the JSON to benchmarks/results/ afterwards.
#   usage (device tool): bash benchmarks/run_on_device.sh <commit sha> [steps...]
#   steps: gpu_tests kernel_tests kernel_tests2 gpu_attention cpu_attention layer_attention step_phases launch_cost launch_behind_spin host_wake host_diag select_forms e2e_lanes_low_share e2e_lanes_selection_modes e2e_lanes_long host_breakdown first_step_fresh timeline_ab_4x32k timeline_ab_both_4x32k check_ab_4x32k pinned_ab_4x32k launch_ab_4x32k native_ab_4x32k native_ab_8x32k native_ab_96k direct_tests direct_layer direct_ab_4x32k direct_ab_long alt_direct_4x32k alt_direct_long alt_selection graphs_ab_llama_4x32k graphs_ab_qwen_4x32k series_4x32k first_steps_ab slack_first_steps first_step_host slow_tokens_96k prepare_ab score_shapes select_latency profiling_tests runtime_tests e2e_decode e2e_part32k e2e_part_long e2e_core_llama e2e_part_qwen e2e_part96k e2e_part128k e2e_ab e2e_selection_ab32k e2e_selection_ab96k e2e_selection_ab_both32k e2e_selection_ab_both96k predictor_overhead
#   tpot_grid nosa asynctls asynctls_host express express_repeat copy_chain express_layers32 express_timers host_timers_fluxion sparda evosparse (default: the first five). kernel_tests, kernel_tests2: the test
#   files of the Triton kernels and the GPU lane, every marker, compiled on CUDA, in two steps of 400 s (one took
#   longer than that on an H200) (on CI they run under the interpreter, which accepts
#   code and expectations the compiled path does not: two such test bugs and a launcher bug hid there). Experiments need matplotlib: carry its wheels
#   in .carry/wheels (the device has no index); tpot_grid runs the grid's first point and returns
#   its run folder as tpot_grid.tgz (a run folder has more files than come back one by one).
set -u
commit=${1:?commit sha under test (the device copy has no .git)}
shift
steps=${*:-gpu_tests kernel_tests kernel_tests2 gpu_attention cpu_attention}
out=${OUT:?run this through the device tool, which sets OUT}
export PYTHONUNBUFFERED=1 HYBRID_COMMIT=$commit PYTHONPATH=$PWD
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
  if ls .carry/wheels/*.whl >/dev/null 2>&1; then pip install -q --no-deps .carry/wheels/*.whl; fi
  pip install -q --no-deps --no-build-isolation -e .; } \
    >"$out/setup.log" 2>&1
# The e2e table's variants every part runs first.
e2e_variants=fluxion,fluxion_every_step,fluxion_unprofiled,dense,offloaded,cpu_only
# The results files' device suffix (h100, h200, ...), as the benchmarks name them themselves.
dev=$(python -c "from hybrid_runtime.profiling.results import device_slug; print(device_slug())" 2>>"$out/setup.log" || echo gpu)
for step in $steps; do
    case $step in
        # -v --tb=short: each test's name and outcome reach the log as it runs, so a step cut by its
        # time limit still says which tests failed (pytest's summary comes only at the end).
        # 560 s: on a cold H200 the 83 tests took more than 400 s (the last 5 were cut at be6af9c).
        gpu_tests) timeout 560 python -m pytest -v --tb=short -m gpu -p no:cacheprovider tests ;;
        kernel_tests) timeout 400 python -m pytest -v --tb=short -p no:cacheprovider tests/test_gpu_kernels.py \
            tests/test_gpu_claims.py tests/test_launch.py tests/test_window_append.py tests/test_sparda.py \
            tests/test_nosa.py ;;
        kernel_tests2) timeout 400 python -m pytest -v --tb=short -p no:cacheprovider tests/test_asynctls.py \
            tests/test_predictor_fused.py tests/test_predictor_model.py tests/test_predicted_plans.py \
            tests/test_gpu_lane_trails.py tests/test_deferred_input_check.py tests/test_step_inputs.py tests/test_gpu_picks.py ;;
        gpu_attention) timeout 150 python benchmarks/gpu_attention.py --rounds 7 --out-dir "$out" ;;
        cpu_attention) timeout 150 python benchmarks/cpu_attention.py --out "$out" ;;
        layer_attention) timeout 590 python benchmarks/layer_attention.py --steps 16 --other-selection --other-claims --out "$out/layer_attention-$dev.json" ;;
        step_phases) timeout 300 python benchmarks/diag/step_phases.py --batch 4 --context 32768 --steps 30 ;;
        launch_cost) timeout 200 python benchmarks/diag/launch_cost.py --batch 8 --context 32768 --steps 20 ;;
        launch_behind_spin) timeout 200 python benchmarks/diag/launch_behind_spin.py --batch 8 --context 32768 ;;
        host_wake) timeout 60 python benchmarks/diag/host_wake.py && timeout 200 python benchmarks/diag/host_wake.py --with-runtime ;;
        # The host's speed beside busy cores (and the hypervisor's steal), and a graph replay's host time
        # alone and behind a stream held by a host-memory wait (benchmarks/notes/e2e_overlap.md section 13).
        host_diag) timeout 90 python benchmarks/diag/neighbour_load.py --rounds 3 &&
            timeout 60 python benchmarks/diag/graph_replay_cost.py --blocked &&
            timeout 60 python benchmarks/diag/graph_replay_cost.py ;;
        # The claim's selection fused and split (a program per head, `score_select.split_select`), at
        # Llama-3.1-8B's and Qwen2.5-7B's heads, 32K to 128K tokens (benchmarks/notes/gpu_lane.md s. 23).
        select_forms) rc=0
            for spec in "--batch 4 --context 32768" "--batch 2 --context 98304" "--batch 4 --context 131072 --reps 10" \
                "--batch 4 --context 32768 --kv-heads 4 --group 7" "--batch 2 --context 98304 --kv-heads 4 --group 7"; do
                timeout 150 python benchmarks/diag/select_latency.py $spec || rc=$?
            done; (exit $rc) ;;
        # Where the GPU lane's share stood lowest in the 864193a table (Qwen2.5-7B at 2 x 96K and 4 x 32K, Llama-3.1-8B
        # at 4 x 32K): the default against the GPU's selection on every step and cpu_only, lane by lane
        # (benchmarks/notes/gpu_lane.md section 24); one log per point.
        e2e_lanes_low_share) rc=0
            for spec in "qwen2.5-7b 2 98304" "qwen2.5-7b 4 32768" "llama-3.1-8b 4 32768"; do
                set -- $spec
                timeout 170 python benchmarks/diag/e2e_lanes.py --model $1 --batch $2 --context $3 \
                    --variants fluxion,fluxion_gpu_selection,cpu_only --rounds 1 >"$out/e2e_lanes-$1-$2x$3.txt" 2>&1 || rc=$?
                grep -E "^## |GPU claim|share .all|steps on|steps sel" "$out/e2e_lanes-$1-$2x$3.txt"
            done; (exit $rc) ;;
        # The lead (q produced to the first task) at the long points, 8.1-8.8 ms a token at 887c1fa
        # (benchmarks/notes/gpu_lane.md section 27): the lanes' host milestones under auto and under the
        # host's selection (which starts on the device's word), interleaved, at Qwen2.5-7B's 2 x 96K and
        # Llama-3.1-8B's 2 x 96K; one log per point.
        e2e_lanes_long) rc=0
            for spec in "qwen2.5-7b 2 98304" "llama-3.1-8b 2 98304"; do
                set -- $spec
                timeout 280 python benchmarks/diag/e2e_lanes.py --model $1 --batch $2 --context $3 \
                    --variants fluxion,fluxion_host_selection,fluxion,fluxion_host_selection --rounds 1 \
                    >"$out/e2e_lanes_long-$1-$2x$3.txt" 2>&1 || rc=$?
                grep -E "^## |q_after_call|decode_host|cpu_first|gpu_first|wake|settled|share .all" "$out/e2e_lanes_long-$1-$2x$3.txt"
            done; (exit $rc) ;;
        # The selection on every step, with and without the trailing gate, against auto without the gate,
        # where the default (auto) and the selection on every step parted most (notes/gpu_lane.md s. 25).
        e2e_lanes_selection_modes) rc=0
            for spec in "qwen2.5-7b 4 32768" "llama-3.1-8b 4 32768"; do
                set -- $spec
                timeout 170 python benchmarks/diag/e2e_lanes.py --model $1 --batch $2 --context $3 \
                    --variants fluxion_gpu_selection,fluxion_gpu_selection_ungated,fluxion_ungated --rounds 1 \
                    >"$out/e2e_lanes_modes-$1-$2x$3.txt" 2>&1 || rc=$?
                grep -E "^## |GPU claim|share .all|steps on|steps sel" "$out/e2e_lanes_modes-$1-$2x$3.txt"
            done; (exit $rc) ;;
        # Where the launching thread's time goes at Llama-3.1-8B's 4 x 32K, the point the thread falls
        # behind the device (README Performance; benchmarks/notes/e2e_overlap.md section 20): the lanes'
        # milestones for fluxion and cpu_only, then cProfile of the generating thread under fluxion.
        host_breakdown) rc=0
            timeout 200 python benchmarks/diag/e2e_lanes.py --model llama-3.1-8b --batch 4 --context 32768 \
                --variants fluxion,cpu_only --rounds 1 >"$out/e2e_lanes-llama-4x32768.txt" 2>&1 || rc=$?
            grep -E "^## |q_after_call|decode_host|cpu_first|merged|^    (run|wake|settled|run_out|record_in|returned) " "$out/e2e_lanes-llama-4x32768.txt"
            timeout 300 python benchmarks/diag/e2e_host_profile.py --batch 4 --context 32768 --tokens 16 \
                --variant fluxion --out "$out" || rc=$?
            (exit $rc) ;;
        # What the timeline costs there: fluxion with it on one token in 8 (the table's), on every token, off,
        # and cpu_only, interleaved twice (the rows' `timeline host` column: the timeline's own host time a token).
        timeline_ab_4x32k) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b --points 4x32K \
            --new-tokens 32 --no-limits --budget-s 540 \
            --variants fluxion,fluxion_every_step,fluxion_unprofiled,cpu_only,fluxion,fluxion_every_step,fluxion_unprofiled,cpu_only \
            --out "$out/e2e_decode_timeline_ab_4x32k-$dev.json" ;;
        # The timeline on one token in 8 (the e2e table's rows since section 22) against every token, four
        # interleaved rounds at both 4 x 32K points.
        timeline_ab_both_4x32k) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b,qwen2.5-7b --points 4x32K \
            --new-tokens 32 --no-limits --budget-s 540 \
            --variants fluxion,fluxion_every_step,fluxion_every_step,fluxion,fluxion,fluxion_every_step,fluxion_every_step,fluxion \
            --out "$out/e2e_decode_timeline_ab_both_4x32k-$dev.json" ;;
        # Host- against device-started layers, each in two fresh processes: a wrong first step showed
        # only in a process's first runtime (notes/e2e_overlap.md section 21), which one pytest run of
        # every gpu test does not reproduce reliably.
        first_step_fresh) rc=0
            for round in 1 2; do
                timeout 120 python -m pytest -q --tb=line -p no:cacheprovider \
                    "tests/test_device_start.py::test_layers_started_on_the_devices_word_give_the_host_started_output" || rc=$?
            done
            (exit $rc) ;;
        # The calling thread confined to the core the workers leave free against the default, at both
        # 4 x 32K points where that thread is the step, three interleaved rounds; the rows' caller
        # columns (involuntary switches, tokens on a worker's core) say whether the slow runs share a core.
        pinned_ab_4x32k) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b,qwen2.5-7b --points 4x32K \
            --new-tokens 32 --no-limits --budget-s 540 \
            --variants fluxion,fluxion_pinned_caller,fluxion,fluxion_pinned_caller,fluxion,fluxion_pinned_caller \
            --out "$out/e2e_decode_pinned_ab_4x32k-$dev.json" ;;
        # The deferred input check counted in the step-inputs kernel (the default) against its own
        # launch, and the timeline on every token, at both 4 x 32K points where the launching
        # thread is the step, interleaved three times; first the CUDA tests of the check's paths.
        check_ab_4x32k) rc=0
            timeout 150 python -m pytest -q --tb=short -p no:cacheprovider tests/test_deferred_input_check.py \
                tests/test_device_start.py tests/test_step_inputs.py "tests/test_sparda.py::test_bad_lookahead_is_refused_before_anything_changes" || rc=$?
            timeout 430 python benchmarks/e2e_decode.py --models llama-3.1-8b,qwen2.5-7b --points 4x32K \
                --new-tokens 32 --no-limits --budget-s 380 \
                --variants fluxion,fluxion_check_launch,fluxion_every_step,fluxion,fluxion_check_launch,fluxion_every_step,fluxion,fluxion_check_launch,fluxion_every_step \
                --out "$out/e2e_decode_check_ab_4x32k-$dev.json" || rc=$?
            (exit $rc) ;;
        # The first decode steps after a prompt with the lanes' estimates learned on the short warm-up (the
        # default) against a warm-up over the whole prompt, every step recorded, interleaved twice at two points
        # (notes/gpu_lane.md section 31).
        first_steps_ab) timeout 540 python benchmarks/e2e_decode.py --models llama-3.1-8b --points 4x32K,2x96K \
            --new-tokens 24 --no-limits --budget-s 500 \
            --variants fluxion_every_step,fluxion_every_step_full_warmup,fluxion_every_step,fluxion_every_step_full_warmup \
            --out "$out/e2e_decode_first_steps_ab-$dev.json" ;;
        # The first decode steps after a prompt with the launcher's slack no longer sampled across the
        # prefill (`Scheduler.end_step_chain`), every step recorded, the gate on and off, with the lane
        # estimates each row's first steps were sized with (`lane_estimates_before`, `..._after_decode_step`).
        slack_first_steps) timeout 540 python benchmarks/e2e_decode.py --models llama-3.1-8b --points 4x32K,2x96K \
            --new-tokens 16 --no-limits --budget-s 480 --timeline-every 1 \
            --variants fluxion,fluxion_ungated,fluxion,fluxion_ungated \
            --out "$out/e2e_decode_slack_first_steps-$dev.json" ;;
        # The host time of the first decode step after a prompt against later ones, layer by layer, and the
        # functions whose host time differs most (benchmarks/diag/first_step_host.py; notes/gpu_lane.md s. 35).
        first_step_host) rc=0
            timeout 240 python benchmarks/diag/first_step_host.py --batch 4 --context 32768 --layers 8 --steps 6 || rc=$?
            timeout 240 python benchmarks/diag/first_step_host.py --batch 2 --context 98304 --layers 8 --steps 6 || rc=$?
            (exit $rc) ;;
        # The 2 x 96K rows of the 2a4c43b table had single tokens at ~3x the median (Llama steps 12 and 20, Qwen
        # step 12): both models, the table's fluxion, twice each, with the rows' per-token host losses (the
        # markdown's slow-token table; benchmarks/notes/e2e_overlap.md section 26).
        slow_tokens_96k) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b,qwen2.5-7b --points 2x96K \
            --variants fluxion,fluxion --no-limits --budget-s 540 \
            --out "$out/e2e_decode_slow_tokens_96k-$dev.json" ;;
        # The prefill leaving the first decode step's task lists built against the step building them, interleaved
        # at both models' 4 x 32K and 2 x 96K; read by the rule of benchmarks/notes/gpu_lane.md section 36.
        prepare_ab) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b,qwen2.5-7b --points 4x32K,2x96K \
            --new-tokens 16 --no-limits --budget-s 540 \
            --variants fluxion,fluxion_unprepared,fluxion,fluxion_unprepared \
            --out "$out/e2e_decode_prepare_ab-$dev.json" ;;
        # Every step's split (`step_series` in each row) at Llama's 4 x 32K, four runs in one process: which
        # of the thread, the lead or a lane carries the slow blocks of tokens (notes/e2e_overlap.md section 24).
        series_4x32k) timeout 330 python benchmarks/e2e_decode.py --models llama-3.1-8b --points 4x32K \
            --new-tokens 48 --no-limits --budget-s 300 \
            --variants fluxion_every_step,fluxion_every_step,fluxion_every_step,fluxion_every_step \
            --out "$out/e2e_decode_series_4x32k-$dev.json" ;;
        # The claim replayed from a CUDA graph against the default, six interleaved rounds at Llama-3.1-8B's
        # 4 x 32K, where 887c1fa's three calls had graphs ahead in 6 of 7 pairs (benchmarks/notes/e2e_overlap.md
        # section 23); read the markdown's paired rounds.
        graphs_ab_llama_4x32k) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b --points 4x32K \
            --new-tokens 32 --no-limits --budget-s 540 \
            --variants fluxion,fluxion_graphs,fluxion,fluxion_graphs,fluxion,fluxion_graphs,fluxion,fluxion_graphs,fluxion,fluxion_graphs,fluxion,fluxion_graphs \
            --out "$out/e2e_decode_graphs_ab_llama_4x32k-$dev.json" ;;
        # ... and at Qwen2.5-7B's 4 x 32K, where they had graphs ahead in 2 of 5 (the rule that settles the
        # default from both: notes/gpu_lane.md section 31).
        graphs_ab_qwen_4x32k) timeout 590 python benchmarks/e2e_decode.py --models qwen2.5-7b --points 4x32K \
            --new-tokens 32 --no-limits --budget-s 540 \
            --variants fluxion,fluxion_graphs,fluxion,fluxion_graphs,fluxion,fluxion_graphs,fluxion,fluxion_graphs,fluxion,fluxion_graphs,fluxion,fluxion_graphs \
            --out "$out/e2e_decode_graphs_ab_qwen_4x32k-$dev.json" ;;
        # The claim issued as one CUDA graph replay or one native call (less of the launcher's host time
        # a layer-step) and the selection on every step, against the default at the same point, twice.
        launch_ab_4x32k) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b --points 4x32K \
            --new-tokens 32 --no-limits --budget-s 540 \
            --variants fluxion,fluxion_graphs,fluxion_native,fluxion_gpu_selection,fluxion,fluxion_graphs,fluxion_native,fluxion_gpu_selection \
            --out "$out/e2e_decode_launch_ab_4x32k-$dev.json" ;;
        # Native claims (one driver call a claim) against the default planned launches, the comparison
        # benchmarks/notes/gpu_lane.md section 38 settles the default by (its rule was written before
        # these runs): six interleaved rounds at both (4, 32K) points, where the generating thread's
        # host work is the step; then three at (8, 32K) and at (2, 96K), both models, one step each.
        native_ab_4x32k) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b,qwen2.5-7b --points 4x32K \
            --new-tokens 24 --no-limits --budget-s 550 \
            --variants fluxion,fluxion_native,fluxion,fluxion_native,fluxion,fluxion_native,fluxion,fluxion_native,fluxion,fluxion_native,fluxion,fluxion_native \
            --out "$out/e2e_decode_native_ab_4x32k-$dev.json" ;;
        native_ab_8x32k) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b,qwen2.5-7b --points 8x32K \
            --new-tokens 24 --no-limits --budget-s 550 \
            --variants fluxion,fluxion_native,fluxion,fluxion_native,fluxion,fluxion_native \
            --out "$out/e2e_decode_native_ab_8x32k-$dev.json" ;;
        native_ab_96k) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b,qwen2.5-7b --points 2x96K \
            --new-tokens 24 --no-limits --budget-s 550 \
            --variants fluxion,fluxion_native,fluxion,fluxion_native,fluxion,fluxion_native \
            --out "$out/e2e_decode_native_ab_96k-$dev.json" ;;
        # Claims issued directly (the planned kernels by one native call, scheduler.claim_launch direct):
        # its CUDA tests, then the layer benchmark with every claim path and the launch behind a spin,
        # then end to end against planned claims, interleaved (benchmarks/notes/gpu_lane.md section 39).
        direct_tests) timeout 400 python -m pytest -v --tb=short -p no:cacheprovider tests/test_gpu_claims.py \
            tests/test_direct_claim.py tests/test_native_claim.py -k "direct or metadata or native or descriptor" ;;
        direct_layer) timeout 300 python benchmarks/layer_attention.py --steps 16 --other-claims \
                --out "$out/layer_attention_claims-$dev.json" &&
            timeout 200 python benchmarks/diag/launch_behind_spin.py --batch 8 --context 32768 \
                --claim-launch direct,plans,native ;;
        direct_ab_4x32k) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b,qwen2.5-7b --points 4x32K \
            --new-tokens 24 --no-limits --budget-s 550 \
            --variants fluxion,fluxion_direct,fluxion,fluxion_direct,fluxion,fluxion_direct,fluxion,fluxion_direct,fluxion,fluxion_direct,fluxion,fluxion_direct \
            --out "$out/e2e_decode_direct_ab_4x32k-$dev.json" ;;
        direct_ab_long) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b,qwen2.5-7b --points 8x32K,2x96K \
            --new-tokens 24 --no-limits --budget-s 550 \
            --variants fluxion,fluxion_direct,fluxion,fluxion_direct \
            --out "$out/e2e_decode_direct_ab_long-$dev.json" ;;
        # Planned and direct claims alternated token by token inside one runtime (benchmarks/token_alternation.py),
        # either way first, and the plans/plans control (benchmarks/notes/gpu_lane.md section 40).
        alt_direct_4x32k) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b,qwen2.5-7b --points 4x32K \
            --new-tokens 64 --no-limits --budget-s 430 \
            --variants fluxion_alt_plans_direct,fluxion_alt_direct_plans,fluxion_alt_plans_plans,fluxion_alt_plans_direct,fluxion_alt_direct_plans,fluxion_alt_plans_direct,fluxion_alt_direct_plans \
            --out "$out/e2e_decode_alt_direct_4x32k-$dev.json" ;;
        alt_direct_long) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b,qwen2.5-7b --points 8x32K,2x96K \
            --new-tokens 48 --no-limits --budget-s 430 \
            --variants fluxion_alt_plans_direct,fluxion_alt_direct_plans \
            --out "$out/e2e_decode_alt_direct_long-$dev.json" ;;
        # The GPU's selection for the CPU lane where it pays (auto, the default) against on every shared step,
        # alternated token by token; both geometries at (4, 32K) and (2, 96K).
        alt_selection) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b,qwen2.5-7b --points 4x32K,2x96K \
            --new-tokens 64 --no-limits --budget-s 500 \
            --variants fluxion_alt_auto_gpu_selection,fluxion_alt_gpu_auto_selection \
            --out "$out/e2e_decode_alt_selection-$dev.json" ;;
        # The split form's scoring launch at other shapes (gpu_kernels/score_select.py SCORE_BLOCK_B / SCORE_NUM_WARPS;
        # benchmarks/notes/gpu_lane.md section 28: 128 x 8 compiles to ~167 registers, one program an SM; 64 x 8 to ~98,
        # 32 x 4 to ~96), at Llama-3.1-8B's 4 x 128K and Qwen2.5-7B's 2 x 96K, with each variant's registers.
        score_shapes) rc=0
            for spec in "--batch 4 --context 131072" "--batch 2 --context 98304 --kv-heads 4 --group 7"; do
                timeout 150 python benchmarks/diag/select_latency.py $spec --reps 10 --no-claims \
                    --score-shapes 128x8,64x8,64x4,32x4,32x8 || rc=$?
            done; (exit $rc) ;;
        select_latency) timeout 100 python benchmarks/diag/select_latency.py --batch 4 --context 32768 &&
            timeout 150 python benchmarks/diag/select_latency.py --batch 4 --context 131072 --reps 10 ;;
        profiling_tests) timeout 120 python -m pytest -v --tb=short -p no:cacheprovider tests/test_profiling.py ;;
        runtime_tests) timeout 400 python -m pytest -v --tb=short -p no:cacheprovider tests/test_runtime.py \
            tests/test_warmup.py tests/test_cpu_lane_trails.py tests/test_step_inputs.py tests/test_deferred_input_check.py ;;
        e2e_decode) timeout 590 python benchmarks/e2e_decode.py --out "$out/e2e_decode-$dev.json" ;;
        # The full Llama-3.1-8B table in three calls (one step per call, made one after another so
        # the machine stays the same); then, here: python benchmarks/e2e_merge.py <the three files>.
        # In order of what the table needs most: what a unit would not fit in the call is left out.
        # One variant list for every part: the rows first (the runtime with its timeline on one
        # token in 8, on every token, and off), then the baselines, then the rest; a unit the call's time
        # limit cuts is lost, the units before it are saved. 540 s: a short step may share the call.
        e2e_part32k) timeout 540 python benchmarks/e2e_decode.py --models llama-3.1-8b --points 4x32K,8x32K \
            --variants $e2e_variants,static,fluxion_predictor,fluxion_eager_model --budget-s 900 \
            --out "$out/e2e_decode_part32k-$dev.json" ;;
        # 2 x 96K and 4 x 128K in one call.
        e2e_part_long) timeout 540 python benchmarks/e2e_decode.py --models llama-3.1-8b --points 2x96K,4x128K \
            --variants $e2e_variants,fluxion_predictor --budget-s 900 \
            --out "$out/e2e_decode_part_long-$dev.json" ;;
        # The core rows of the Llama-3.1-8B table in one call: every point, the runtime (fluxion,
        # its timeline on every step), HF dense, HF offloaded and cpu_only (~7 min on the H200).
        e2e_core_llama) timeout 540 python benchmarks/e2e_decode.py --models llama-3.1-8b --points 4x32K,8x32K,2x96K,4x128K \
            --variants fluxion,dense,offloaded,cpu_only --budget-s 900 \
            --out "$out/e2e_decode_core_llama-$dev.json" ;;
        # The second geometry (Qwen2.5-7B: 28 layers, 4 KV heads), every point, the rows only.
        e2e_part_qwen) timeout 540 python benchmarks/e2e_decode.py --models qwen2.5-7b --points 4x32K,8x32K,2x96K,4x128K \
            --variants fluxion,dense,offloaded --budget-s 900 \
            --out "$out/e2e_decode_part_qwen-$dev.json" ;;
        e2e_part96k) timeout 540 python benchmarks/e2e_decode.py --models llama-3.1-8b --points 2x96K \
            --variants $e2e_variants,static,fluxion_predictor,fluxion_eager_model --budget-s 900 \
            --out "$out/e2e_decode_part96k-$dev.json" ;;
        e2e_part128k) timeout 540 python benchmarks/e2e_decode.py --models llama-3.1-8b --points 4x128K \
            --variants $e2e_variants,fluxion_predictor,fluxion_eager_model --budget-s 900 \
            --out "$out/e2e_decode_part128k-$dev.json" ;;
        # fluxion against cpu_only with the caller pinned to the free core and the trailing gate off,
        # interleaved twice at the two 32K points (a variant's single run moves 20-35% on one lease).
        e2e_ab) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b --points 4x32K,8x32K --new-tokens 32 \
            --variants fluxion,cpu_only,fluxion_pinned_caller,cpu_only_pinned_caller,fluxion_ungated,fluxion,cpu_only,fluxion_pinned_caller,cpu_only_pinned_caller,fluxion_ungated \
            --budget-s 555 --out "$out/e2e_decode_ab-$dev.json" ;;
        # The GPU selection on every step and workers that sleep at once, each against the default,
        # interleaved three times (a variant's single run moves 20-35% with the host's speed):
        # benchmarks/notes/e2e_overlap.md section 12.
        e2e_selection_ab32k) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b --points 4x32K,8x32K \
            --new-tokens 32 --no-limits --budget-s 2000 --variants fluxion,fluxion_gpu_selection,fluxion_no_spin,fluxion,fluxion_gpu_selection,fluxion_no_spin,fluxion,fluxion_gpu_selection,fluxion_no_spin \
            --out "$out/e2e_decode_selection_ab32k-$dev.json" ;;
        e2e_selection_ab96k) timeout 590 python benchmarks/e2e_decode.py --models llama-3.1-8b --points 2x96K \
            --new-tokens 32 --no-limits --budget-s 2000 --variants fluxion,fluxion_gpu_selection,fluxion_no_spin,fluxion,fluxion_gpu_selection,fluxion_no_spin,fluxion,fluxion_gpu_selection,fluxion_no_spin \
            --out "$out/e2e_decode_selection_ab96k-$dev.json" ;;
        # auto (the default) against the selection on every step, interleaved x3, both geometries, now that
        # auto's estimates re-measure a lane they keep out (1a19f43; notes/gpu_lane.md s. 25).
        e2e_selection_ab_both32k) timeout 590 python benchmarks/e2e_decode.py --models qwen2.5-7b,llama-3.1-8b \
            --points 4x32K,8x32K --new-tokens 32 --no-limits --budget-s 2000 \
            --variants fluxion,fluxion_gpu_selection,fluxion,fluxion_gpu_selection,fluxion,fluxion_gpu_selection \
            --out "$out/e2e_decode_selection_ab_both32k-$dev.json" ;;
        e2e_selection_ab_both96k) timeout 590 python benchmarks/e2e_decode.py --models qwen2.5-7b,llama-3.1-8b \
            --points 2x96K --new-tokens 32 --no-limits --budget-s 2000 \
            --variants fluxion,fluxion_gpu_selection,fluxion,fluxion_gpu_selection \
            --out "$out/e2e_decode_selection_ab_both96k-$dev.json" ;;
        predictor_overhead) timeout 590 python benchmarks/predictor_overhead.py --compile --fused-variant lag1:lag=1 --out-dir "$out" ;;
        tpot_grid) work=$(mktemp -d)
            timeout 590 python -m hybrid_runtime.cli run configs/tpot_grid.yaml --out "$work/tpot" \
                --set 'experiment.points=[{batch: 4, context: 32768}]'
            rc=$?; tar czf "$out/tpot_grid.tgz" -C "$work" .; (exit $rc) ;;
        nosa) timeout 590 python benchmarks/nosa.py --out "$out/nosa-$dev.json" ;;
        asynctls) timeout 590 python benchmarks/asynctls.py --out "$out/asynctls-$dev.json" ;;
        # The point with the quality config's two resident steps, then where a GPU-only step's host time
        # goes and the host-path changes against their old form (benchmarks/notes/asynctls.md section 13).
        asynctls_host) timeout 150 python benchmarks/asynctls.py --points 8x32768 --resident-steps 2 \
                --out "$out/asynctls-$dev.json" &&
            timeout 150 python benchmarks/diag/decode_host_timers.py --batch 8 --context 32768 --steps 150 &&
            timeout 150 python benchmarks/diag/asynctls_host_ab.py --batch 8 --context 32768 --steps 250 ;;
        # The express path for GPU-only steps (benchmarks/notes/asynctls.md section 14): its GPU tests, then the
        # AsyncTLS bar at (8, 32K) with lagged_general (the same steps through the lanes' loop) beside it.
        # Its mode lagged_step_graphs: the runtime's graphs of whole GPU-only steps on (hybrid_runtime/step_graphs.py).
        express) timeout 240 python -m pytest -v --tb=short -p no:cacheprovider tests/test_asynctls.py \
                tests/test_express_claims.py tests/test_step_graphs.py tests/test_window_graphs.py tests/test_gpu_lane_trails.py &&
            timeout 240 python benchmarks/asynctls.py --points 8x32768 --breakdown 0 --out "$out/asynctls-$dev.json" ;;
        # The bar three times on one lease (its spread between runs: benchmarks/notes/asynctls.md section 15); the last
        # run is the results file, the first two land beside it as asynctls_run1/2.
        express_repeat) rc=0
            for i in 1 2 3; do
                name=asynctls_run$i; [ $i = 3 ] && name=asynctls
                timeout 150 python benchmarks/asynctls.py --points 8x32768 --breakdown 0 --out "$out/$name-$dev.json" || rc=1
            done
            [ $rc = 0 ] ;;
        # The GPU chain of lagged layer-steps with the model's GEMMs between them, interval by interval: the lagged copy
        # as configured, left out, and on fewer or more programs (benchmarks/notes/asynctls.md section 15).
        copy_chain) timeout 300 python benchmarks/diag/asynctls_layer_chain.py --batch 8 --context 32768 --steps 40 \
            --step-graphs --model-work --variants copy,skip,programs=16,programs=32,programs=132 ;;
        # The bar over a whole model's 32 layers (the default run has 4: each step's fill and drain weigh more there).
        express_layers32) timeout 300 python benchmarks/asynctls.py --points 8x32768 --layers 32 --steps 12 --warmup 3 \
            --breakdown 0 --out "$out/asynctls_layers32-$dev.json" ;;
        # The host timers of a GPU-only AsyncTLS step on the express path and through the lanes' loop.
        express_timers) timeout 120 python benchmarks/diag/decode_host_timers.py --batch 8 --context 32768 --steps 100 &&
            timeout 120 python benchmarks/diag/decode_host_timers.py --batch 8 --context 32768 --steps 100 --general ;;
        # The hybrid lanes' step (fluxion, fixed (16, 0.05), 15 workers) timed function by function, without a profiler.
        host_timers_fluxion) timeout 240 python benchmarks/diag/decode_host_timers.py --runtime fluxion --batch 4 \
            --context 32768 --layers 4 --steps 100 ;;
        sparda) timeout 590 python benchmarks/sparda.py --out "$out/sparda-$dev.json" ;;
        evosparse) timeout 590 python benchmarks/evosparse.py --out "$out/evosparse-$dev.json" ;;
        *) echo "unknown step $step"; false ;;
    esac >"$out/$step.log" 2>&1
    echo "$step rc=$?"
    tail -n 6 "$out/$step.log"
done
