"""The engine core's numbers: the /stats snapshot (sent with every `CoreOutputs`) and the memory
accounting by component."""

from treadle.utils import process_memory


def memory(worker, tiers=None) -> dict:
    """This process's memory by component, in bytes: the model side's (weights, also by type; the
    KV pool; compiled decode graphs; the background compiler's resident set, another process), the
    rest (torch, Python, tokenizer, buffers); its resident set now and at its peak."""
    status = process_memory()
    parts = worker.memory()
    rss = status.get("VmRSS")
    parts["lora_bytes"] = worker.runner.lora_bytes()
    parts["kv_offload_bytes"] = (
        tiers.host.nbytes if tiers is not None and tiers.host is not None else 0
    )  # the host tier's pages
    # the pool's resident pages, not its size: its blocks become resident as they are first written
    held = (
        parts["weights_bytes"]
        + parts["kv_cache_resident_bytes"]
        + parts["compiled_graphs_bytes"]
        + parts["lora_bytes"]
        + parts["kv_offload_bytes"]
    )
    return {
        **parts,
        "other_bytes": None if rss is None else rss - held,
        "rss_bytes": rss,
        "peak_rss_bytes": status.get("VmHWM"),
    }


def snapshot(core) -> dict:
    """Everything /stats shows of one engine core."""
    pool, scheduler, config = core.kv.pool, core.scheduler, core.config
    events = core.kv_events
    return {
        "kv_blocks_total": pool.num_blocks,
        "kv_blocks_free": pool.num_free_blocks,
        "kv_blocks_used": pool.num_blocks - pool.num_free_blocks,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "num_preemptions": scheduler.num_preemptions,
        "block_size": config.block_size,
        "enable_prefix_caching": core.kv.enable_caching,
        "kv_events_endpoint": events.endpoint if events else None,
        "kv_events_replay_endpoint": events.replay_endpoint if events else None,
        "prefix_cache_queries": scheduler.prefix_cache_queries,
        "prefix_cache_hits": scheduler.prefix_cache_hits,
        "prompt_tokens_computed": core.prompt_tokens_computed,
        "generation_tokens": scheduler.generation_tokens,
        "steps": core.num_steps,
        "failed_steps": core.num_failed_steps,
        "requests_received": core.requests_received,
        "compiled_decode": core.worker.compile_status(),
        "batch_invariant": core.worker.batch_invariant,
        "spec_decode": core.spec.stats() if core.spec is not None else None,
        "step_cost": {
            **core.step_cost.snapshot(),
            "prefill_cap": core.step_cost.prefill_cap(config.decode_stall_ratio),
        },
        "architecture": core.model_config.architecture,
        "num_waiting_for_grammar": core.structured.num_waiting,
        "grammars_compiled": core.structured.compiler.compiled,
        "grammar_cache_hits": core.structured.compiler.cache_hits,
        "kv_tiers": core.kv.tiers.stats() if core.kv.tiers is not None else None,
        "memory": memory(core.worker, core.kv.tiers),
        "lora_adapters": sorted(core.loras),
        "encoder_cache": core.worker.encoder_cache_stats(),
    }
