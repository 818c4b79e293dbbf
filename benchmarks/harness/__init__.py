"""What the benchmark suites share, as a library (never run as a script). A suite
(benchmarks/<name>.py) imports these and product code, never another suite.

    shapes.py          model shapes and LoRA targets (LLAMA2_7B, TINY_LLAMA, RANK, TARGETS, ...)
    prompts.py         exact-length and readable prompts; Requests
    traces.py          the shared conv trace: prompt lengths at its quantiles, arrivals paced to a rate
    serving.py         an Engine run in-process, and the ways to send it requests (serve, replay, first token)
    bare_steps.py      engine steps without the engine's thread
    load_stall.py      streams' gaps while other requests arrive (the adapter tiers' "no stall")
    adapter_files.py   real PEFT adapter files in an adapter store
    reference_rates.py what the hardware gives: a page-locked copy, a plain read
    lora_impls.py      the LoRA op implementations kernel_bench compares
    lora_cases.py      kernel_bench's cases (a batch on n adapters), their roofline bytes and random inputs
    live_system.py     the real system on loopback (also the integration tests' launcher)
    ports.py           free loopback ports
    http_client.py     the raw HTTP/1.1 client of the load suites
    completions.py     streaming completions through the gateway
    report.py          progress, rows, the one percentile definition, markdown tables, the JSON report
    cli.py             the suites' command-line conventions
"""
