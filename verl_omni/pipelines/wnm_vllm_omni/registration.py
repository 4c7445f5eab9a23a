"""Registers the WNM pipeline with vLLM-Omni's diffusion model registry (out-of-tree plugin).

``pyproject.toml`` declares :func:`register` under the ``vllm_omni.general_plugins`` entry-point group, which
vLLM-Omni loads in every process it starts (engine, stage and worker processes), so that
``model_class_name="WNMDiTPipeline"`` resolves there. It does nothing when vllm_omni is not installed.

``python -m verl_omni.pipelines.wnm_vllm_omni.registration --check`` imports vllm, vllm_omni and our
pipeline, registers it and resolves it through the registry (used by ``scripts/check_vllm_omni.sh``).
"""

from __future__ import annotations

import sys

PIPELINE_MODULE = "verl_omni.pipelines.wnm_vllm_omni.pipeline"
PIPELINE_CLASS = "WNMDiTPipeline"
POST_PROCESS_FUNC = "get_wnm_post_process_func"


def register() -> bool:
    """Registers ``WNMDiTPipeline``; returns False (quietly) when vllm_omni is not importable."""
    try:
        from vllm_omni.diffusion.registry import register_diffusion_model
    except ImportError:
        return False
    from verl_omni.pipelines.wnm_vllm_omni.pipeline import PIPELINE_ARCH

    register_diffusion_model(PIPELINE_ARCH, PIPELINE_MODULE, PIPELINE_CLASS, post_process_func_name=POST_PROCESS_FUNC)
    return True


def check() -> int:
    import importlib.metadata as md

    import vllm  # noqa: F401
    import vllm_omni  # noqa: F401
    from vllm_omni.diffusion.registry import DiffusionModelRegistry

    from verl_omni.pipelines.wnm_vllm_omni.extra import check_pinned_versions, version_report
    from verl_omni.pipelines.wnm_vllm_omni.pipeline import PIPELINE_ARCH, WNMDiTPipeline

    print(f"imported {version_report()}")
    diff = check_pinned_versions()
    print("pinned version set:", "OK" if not diff else f"differs: {diff}")
    if not register():
        print("register() returned False", file=sys.stderr)
        return 1
    cls = DiffusionModelRegistry._try_load_model_cls(PIPELINE_ARCH)
    ok = cls is WNMDiTPipeline
    print(f"registry resolves {PIPELINE_ARCH} -> {cls!r}: {'OK' if ok else 'MISMATCH'}")
    eps = [ep.value for ep in md.entry_points(group="vllm_omni.general_plugins") if ep.value.startswith("verl_omni")]
    print(f"entry point vllm_omni.general_plugins: {eps or 'MISSING (reinstall verl-omni)'}")
    plat = [ep.value for ep in md.entry_points(group="vllm_omni.platform_plugins") if ep.value.startswith("verl_omni")]
    print(f"entry point vllm_omni.platform_plugins: {plat or 'MISSING (reinstall verl-omni)'}")
    from vllm_omni.platforms import current_omni_platform

    print(f"vLLM-Omni platform: {type(current_omni_platform).__module__}.{type(current_omni_platform).__name__}")
    return 0 if ok and eps and plat else 1


if __name__ == "__main__":
    if "--check" in sys.argv[1:]:
        sys.exit(check())
    print(register())
