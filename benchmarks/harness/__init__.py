"""What the benchmark suites share, as a library (never run as a script): model shapes, prompts and
traces, the in-process engine, the live system on loopback, its HTTP client, adapter files, reports
and the command-line conventions. A suite (benchmarks/<name>.py) imports these and product code,
never another suite."""
