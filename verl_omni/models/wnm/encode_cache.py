"""A Stage-II round's encoded rows on disk while the round is in progress.

Encoding a large collection (decoding its videos and running the frozen encoders) takes minutes on a GPU machine
that lends 10-minute calls. :class:`EncodeCache` keeps the work of a call that is cut off: the training episodes
are encoded in parts, each part is saved when it is done (temporary name, then rename), and a final ``rest.pt``
(the held-out rows) marks the encoding complete. ``source.json`` names what the rows were encoded by and from
(the model and the collection); a folder from another source is removed, never mixed in.

Layout of the folder::

    source.json          the source the parts belong to
    part_0000.pt ...     EncodedRows of consecutive slices of the training episodes (+ the fresh model's state)
    rest.pt              whatever the driver needs once every part is there (held-out rows, probe states)
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from .encoded_rows import EncodedRows

ROW_SOURCES = ("text_encoder", "image_encoder", "geometry_encoder")  # encoders whose features rows cache


def rows_fingerprint(model, refreshed: tuple[str, ...]) -> str:
    """sha256 of everything an encoded row depends on besides the features of the ``refreshed`` encoders.

    That is the model config, the VAE's weights and latent statistics, the action normalization and the weights of
    the encoders not in ``refreshed``. Two models with the same fingerprint encode a collection into the same rows
    up to the ``refreshed`` encoders' features, which ``encoded_rows.refresh_features`` recomputes from the rows'
    raw inputs: so a run can take over rows another model of its lineage encoded (``train_stage2.py
    --reuse-encoded``) instead of decoding and encoding the collection again.

    Args:
        model: A ``WNMModel``.
        refreshed: Names (of :data:`ROW_SOURCES`) of the encoders whose features are recomputed.
    """
    h = hashlib.sha256()
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    norm = model.action_normalization
    h.update(json.dumps({"mean": list(norm.mean), "std": list(norm.std), "refreshed": sorted(refreshed)}).encode())
    for buf in (model.latents_mean, model.latents_std):
        h.update(buf.detach().float().cpu().contiguous().numpy().tobytes())
    for name in ("vae", *(n for n in ROW_SOURCES if n not in refreshed)):
        module = getattr(model, name)
        if module is None:
            continue
        for key, value in sorted(module.state_dict().items()):
            h.update(f"{name}.{key}:{value.dtype}:{tuple(value.shape)}".encode())
            h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class EncodeCache:
    """The parts of one round's encoding in ``root``.

    Args:
        root: The folder (created; a folder with another ``source.json`` is removed first).
        source: JSON-able description of the encoding model and the collection (e.g. their sha256 digests).
        log: Where messages about discarded files go.
    """

    def __init__(self, root: Path, source: dict, log: Callable[[str], None] = print) -> None:
        self.root = Path(root)
        self.log = log
        source = json.loads(json.dumps(source, sort_keys=True))  # as read back (tuples become lists)
        meta = self.root / "source.json"
        if self.root.is_dir() and not (meta.is_file() and json.loads(meta.read_text()) == source):
            log(f"{self.root.name} was encoded by another model or from another collection; encoding again")
            shutil.rmtree(self.root)
        if not self.root.is_dir():
            tmp = self.root.with_name(self.root.name + ".partial")
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            (tmp / "source.json").write_text(json.dumps(source, sort_keys=True) + "\n")
            tmp.replace(self.root)

    def _save(self, name: str, obj: dict) -> None:
        tmp = self.root / (name + ".partial")
        torch.save(obj, tmp)
        tmp.replace(self.root / name)

    def _load(self, name: str) -> dict | None:
        path = self.root / name
        if not path.is_file():
            return None
        # Our own files (written by _save in a run folder); they hold dataclasses, so not weights_only.
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # truncated, or from another version of the code: that piece is encoded again
            self.log(f"{path}: unreadable ({type(e).__name__}: {e}); encoding it again")
            return None

    def save_part(self, index: int, rows: EncodedRows, model=None) -> None:
        """Saves part ``index``; with ``model`` (a fresh one) also its weights, latent statistics and action
        normalization, which encoding fitted and the rows depend on."""
        state = None
        if model is not None:
            state = {
                "weights": {k: v.cpu() for k, v in model.state_dict().items()},
                "latents": (model.latents_mean.flatten().tolist(), model.latents_std.flatten().tolist()),
                "action_normalization": model.action_normalization,
            }
        self._save(f"part_{index:04d}.pt", {"rows": rows.to("cpu"), "model_state": state})

    def load_part(self, index: int, model) -> EncodedRows | None:
        """Part ``index`` on the CPU (restoring a saved model state into ``model``), or None if it is not saved."""
        saved = self._load(f"part_{index:04d}.pt")
        if saved is None:
            return None
        if saved["model_state"] is not None:
            st, device = saved["model_state"], model.device
            model.load_state_dict(st["weights"])
            model.set_latent_statistics(*st["latents"])
            model.action_normalization = st["action_normalization"]
            model.to(device)
        return saved["rows"]

    def save_rest(self, rest: dict) -> None:
        """Marks the encoding complete, with what the driver needs besides the parts."""
        self._save("rest.pt", rest)

    def load_rest(self) -> dict | None:
        """What :meth:`save_rest` stored, or None while the encoding is incomplete."""
        return self._load("rest.pt")
