"""vLLM-Omni worker extension: the RPCs our client sends to every diffusion worker (no vllm import).

vLLM-Omni mixes ``worker_extension_cls`` into its ``DiffusionWorker``; ``collective_rpc("wnm_...")`` then
runs these methods on every rank, between scheduler steps (never concurrently with a forward). They reach
the pipeline as ``self.model_runner.pipeline``. Contexts and weight buckets go to every rank (each rank
samples with them under sequence/CFG parallelism); results are taken from rank 0.
"""

from __future__ import annotations

from verl_omni.pipelines.wnm_vllm_omni.weight_sync import WeightBucket

WORKER_EXTENSION = "verl_omni.pipelines.wnm_vllm_omni.worker_ext.WNMWorkerExtension"


class WNMWorkerExtension:
    """Methods added to vLLM-Omni's diffusion worker (``self`` is the worker)."""

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
