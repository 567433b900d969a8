"""The planner: performance and memory models, cluster presets, plan search and pictures.

It reads the compiler's decisions (spec_cost.py through tp_decisions.py) and the runtime's
schedules (memory.py, timeline.py), and its plans are `threefold.Plan` values; nothing on
the compiler or runtime side imports it.

    cluster.py       Cluster from a preset (clusters/*.toml) or a TOML file
    model_cost.py    Op and ModelCost: what a model costs per token, split or replicated over tp
    gpt_cost.py      ModelCost of a GPT shape (the paper's Eq. 3, Megatron's kernels)
    spec_cost.py     ModelCost of a traced SPEC, from the tensor-parallel pass's decisions
    tp_decisions.py  reads those decisions off the compiled program
    estimate.py      Config (a Plan and the global batch) -> Estimate: time per iteration
    memory.py        memory per rank by component (inspect --memory, fits, the search)
    saved_bytes.py   saved-for-backward bytes of a graph, its ops run on fakes under saved-tensor hooks
    constraints.py   a partial plan to match (--evaluate), in Plan's grammar
    search.py        legal configurations, ranked
    record.py        the JSON form of one ranked plan
    timeline.py      a plan's pipeline picture, from the runtime's schedule and simulator
    paper_table1.py  the paper's Table 1 (and its 175B figure), which the model is validated against
    calibrate.py     the one fitted constant (matmul_fraction), least squares against those runs
"""
