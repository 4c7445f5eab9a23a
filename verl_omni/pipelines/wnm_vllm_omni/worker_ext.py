"""vLLM-Omni worker extension: the RPCs our client sends to every diffusion worker (no vllm import).

vLLM-Omni mixes ``worker_extension_cls`` into its ``DiffusionWorker``; ``collective_rpc("wnm_...")`` then
runs these methods on every rank, between scheduler steps (never concurrently with a forward). They reach
the pipeline as ``self.model_runner.pipeline``. Contexts and weight buckets go to every rank (each rank
samples with them under sequence/CFG parallelism); results are taken from rank 0.
"""

from __future__ import annotations

import gc

from verl_omni.pipelines.wnm_vllm_omni.weight_sync import WeightBucket

WORKER_EXTENSION = "verl_omni.pipelines.wnm_vllm_omni.worker_ext.WNMWorkerExtension"


class WNMWorkerExtension:
    """Methods added to vLLM-Omni's diffusion worker (``self`` is the worker)."""

    def re_init_pipeline(self, custom_pipeline_args: dict) -> None:
        """Builds the pipeline named by ``custom_pipeline_args["pipeline_class"]`` in this worker.

        vLLM-Omni 0.28 calls it right after creating a worker whose engine got ``custom_pipeline_args``
        (``diffusion_worker.py``, ``WorkerWrapperBase``); with our extension set, vLLM-Omni's own
        ``CustomPipelineWorkerExtension`` is not mixed in, so the same step is done here through the worker's
        ``load_model(load_format="custom_pipeline")``, which builds the class with ``od_config`` under the
        worker's forward context (our pipeline then loads the DiT from ``od_config.model``).
        """
        name = (custom_pipeline_args or {}).get("pipeline_class")
        if not name:
            raise ValueError("re_init_pipeline: custom_pipeline_args has no 'pipeline_class' (VllmOmniEngineConfig)")
        runner = getattr(self, "model_runner", None)
        if runner is not None and getattr(runner, "pipeline", None) is not None:
            runner.pipeline = None
            gc.collect()
        self.load_model(load_format="custom_pipeline", custom_pipeline_name=name)
        init_lora = getattr(self, "init_lora_manager", None)
        if callable(init_lora):
            init_lora()

    def _wnm_core(self):
        runner = getattr(self, "model_runner", None)
        pipeline = getattr(runner, "pipeline", None)
        core = getattr(pipeline, "core", None)
        if core is None:
            raise RuntimeError(
                f"the diffusion worker's pipeline is {type(pipeline).__name__}, not the WNM pipeline "
                "(model_class_name must be WNMDiTPipeline)"
            )
        return core

    def wnm_put_contexts(self, key: str, contexts) -> int:
        return self._wnm_core().put_contexts(key, contexts)

    def wnm_drop_contexts(self, key: str) -> bool:
        return self._wnm_core().drop_contexts(key)

    def wnm_take_results(self, request_ids: list[str]) -> list[dict]:
        return self._wnm_core().take_results(request_ids)

    def wnm_begin_weight_sync(self, version: int, num_buckets: int) -> None:
        self._wnm_core().begin_weight_sync(version, num_buckets)

    def wnm_load_weight_bucket(self, bucket: WeightBucket) -> None:
        self._wnm_core().load_weight_bucket(bucket)

    def wnm_commit_weight_sync(self, version: int) -> int:
        return self._wnm_core().commit_weight_sync(version)

    def wnm_weight_version(self) -> int:
        return self._wnm_core().weight_version
