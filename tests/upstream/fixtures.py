"""Synthetic mini-SGLang releases and a 4-patch fixture series for upstream-status,
rebase and pr-export tests (offline: a local PEP 691 index over HTTP)."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import subprocess
import threading
import zipfile
from pathlib import Path

PIN = "0.5.13.post1"
COMM = "sglang/srt/layers/communicator.py"
DSV2 = "sglang/srt/models/deepseek_v2.py"
LOGITS = "sglang/srt/layers/logits_processor.py"
AUX = "sglang/srt/layers/aux_hidden_states.py"

PIN_COMM = '''\
def apply_flashinfer_allreduce_fusion(batch_size):
    return batch_size < 128


class AttnTpContext:
    input_scattered = False


def get_attn_tp_context():
    return AttnTpContext()


class LayerCommunicator:
    def prepare_attn_and_capture_last_layer_outputs(
        self,
        hidden_states,
        residual,
        forward_batch,
        captured_last_layer_outputs=None,
    ):
        hidden_states, residual = self.prepare_attn(
            hidden_states, residual, forward_batch
        )
        if captured_last_layer_outputs is not None:
            gathered = residual
            if gathered is residual:
                gathered = residual.clone()
            captured_last_layer_outputs.append(gathered)
        return hidden_states, residual

    def prepare_attn(self, hidden_states, residual, forward_batch, quant_format=""):
        if get_attn_tp_context().input_scattered:
            hidden_states = hidden_states
        if apply_flashinfer_allreduce_fusion(hidden_states.shape[0]):
            hidden_states = hidden_states
        return hidden_states, residual
'''

PIN_DSV2 = '''\
class DeepseekV2DecoderLayer:
    def forward(self, positions, hidden_states, forward_batch, residual):
        hidden_states, residual = self.layer_communicator.prepare_attn(
            hidden_states, residual, forward_batch
        )
        hidden_states = self.self_attn(hidden_states)
        return hidden_states, residual


class DeepseekV2Model:
    def forward(self, positions, forward_batch):
        hidden_states, residual = self.embed(positions), None
        aux_hidden_states = []
        for i in range(self.start_layer, self.end_layer):
            if i in self.layers_to_capture:
                aux_hidden_states.append(hidden_states + residual)
            layer = self.layers[i]
            hidden_states, residual = layer(
                positions, hidden_states, forward_batch, residual
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        if len(aux_hidden_states) == 0:
            return hidden_states
        return hidden_states, aux_hidden_states
'''

PIN_LOGITS = '''\
import torch


class LogitsProcessor:
    def forward(self, hidden_states, aux_hidden_states=None):
        if aux_hidden_states is not None:
            aux_hidden_states = torch.cat(aux_hidden_states, dim=-1)
        return hidden_states, aux_hidden_states
'''

# ---- our patches, as (file, old, new) edits applied in order ----

A_EDITS = [
    (COMM, "        captured_last_layer_outputs=None,\n    ):\n",
     "        captured_last_layer_outputs=None,\n        quant_format=\"\",\n    ):\n"),
    (COMM, "            if gathered is residual:\n",
     "            if gathered is residual and not self._post_attn_residual_is_read_only(\n"
     "                residual\n            ):\n"),
    (COMM, "        return hidden_states, residual\n\n    def prepare_attn(",
     "        return hidden_states, residual\n\n"
     "    def _post_attn_residual_is_read_only(self, residual):\n"
     "        if get_attn_tp_context().input_scattered:\n"
     "            return False\n"
     "        return apply_flashinfer_allreduce_fusion(residual.shape[0])\n\n"
     "    def prepare_attn("),
]
A2_EDITS = [
    (DSV2, "    def forward(self, positions, hidden_states, forward_batch, residual):\n"
           "        hidden_states, residual = self.layer_communicator.prepare_attn(\n"
           "            hidden_states, residual, forward_batch\n        )\n",
     "    def forward(\n        self,\n        positions,\n        hidden_states,\n"
     "        forward_batch,\n        residual,\n        captured_last_layer_outputs=None,\n    ):\n"
     "        hidden_states, residual = (\n"
     "            self.layer_communicator.prepare_attn_and_capture_last_layer_outputs(\n"
     "                hidden_states,\n                residual,\n                forward_batch,\n"
     "                captured_last_layer_outputs=captured_last_layer_outputs,\n"
     "            )\n        )\n"),
    (DSV2, "            if i in self.layers_to_capture:\n"
           "                aux_hidden_states.append(hidden_states + residual)\n", ""),
    (DSV2, "                positions, hidden_states, forward_batch, residual\n            )\n",
     "                positions,\n                hidden_states,\n                forward_batch,\n"
     "                residual,\n                captured_last_layer_outputs=(\n"
     "                    aux_hidden_states if i in self.layers_to_capture else None\n"
     "                ),\n            )\n"),
]
AUX_MODULE_TEXT = '''\
import torch


class AuxHiddenStatePacker:
    copies_on_append = True

    def __init__(self, num_captures):
        self.num_captures = num_captures
        self.buffer = None
        self.count = 0

    def append(self, hidden):
        if self.buffer is None:
            self.buffer = hidden.new_empty(
                hidden.shape[0], hidden.shape[1] * self.num_captures
            )
        width = hidden.shape[1]
        self.buffer[:, self.count * width : (self.count + 1) * width].copy_(hidden)
        self.count += 1

    def finalize(self):
        if self.count != self.num_captures:
            raise RuntimeError("wrong number of captures")
        return self.buffer
'''
B_EDITS = [
    (AUX, None, AUX_MODULE_TEXT),
    (LOGITS, "import torch\n",
     "import torch\n\nfrom sglang.srt.layers.aux_hidden_states import AuxHiddenStatePacker\n"),
    (LOGITS, "        if aux_hidden_states is not None:\n",
     "        if aux_hidden_states is not None and not isinstance(\n"
     "            aux_hidden_states, torch.Tensor\n        ):\n"),
    (DSV2, "        aux_hidden_states = []\n",
     "        aux_hidden_states = AuxHiddenStatePacker(len(self.layers_to_capture))\n"),
    (DSV2, "        return hidden_states, aux_hidden_states\n",
     "        return hidden_states, aux_hidden_states.finalize()\n"),
]
C_EDITS = [
    (DSV2, "        hidden_states, _ = self.norm(hidden_states, residual)\n",
     "        if self.end_layer in self.layers_to_capture:\n"
     "            aux_hidden_states.append(hidden_states + residual)\n"
     "        hidden_states, _ = self.norm(hidden_states, residual)\n"),
]

SERIES = [
    ("comm-readonly-residual", "Skip the aux capture clone when the residual is read-only",
     "yes", "0.5.14", A_EDITS),
    ("dsv2-capture-after-allreduce", "Capture deepseek_v2 aux states after the all-reduce",
     "yes", "0.5.14", A2_EDITS),
    ("aux-packer", "Pack aux hidden states in place", "yes", "0.5.17", B_EDITS),
    ("dsv2-capture-final-layer", "Capture the final layer's aux hidden state",
     "yes", "none", C_EDITS),
]


def apply_edits(files: dict[str, str], edits) -> dict[str, str]:
    files = dict(files)
    for rel, old, new in edits:
        if old is None:
            files[rel] = new
            continue
        assert old in files[rel], (rel, old)
        files[rel] = files[rel].replace(old, new, 1)
    return files


def pin_files() -> dict[str, str]:
    return {
        "sglang/__init__.py": "",
        COMM: PIN_COMM,
        DSV2: PIN_DSV2,
        LOGITS: PIN_LOGITS,
    }


def release_files() -> dict[str, dict[str, str]]:
    """Upstream's own (differently worded) versions of the changes."""
    pin = pin_files()
    r14 = apply_edits(pin, A_EDITS + A2_EDITS)
    # upstream names the decider differently and words the condition its own way
    r14[COMM] = r14[COMM].replace("_post_attn_residual_is_read_only", "_residual_survives_norm")
    r15 = dict(r14)
    # unrelated upstream churn: offsets, not fuzz (a hunk at line 1 is anchored to the
    # start of the file by git apply, so the logits processor grows at its end instead)
    r15[DSV2] = "# upstream churn\n# more churn\n\n" + r15[DSV2]
    r15[COMM] = "# upstream churn\n# more churn\n\n" + r15[COMM]
    r15[LOGITS] = r15[LOGITS] + "\n\ndef unrelated():\n    return None\n"
    r17 = dict(r15)
    # upstream's packer: no copies_on_append, a capture(owned=) protocol instead
    r17[AUX] = (
        AUX_MODULE_TEXT.replace("    copies_on_append = True\n\n", "")
        .replace("    def finalize(self):", "    def capture(self, hidden, *, owned=False):\n"
                 "        self.append(hidden)\n\n    def finalize(self):")
    )
    r17[LOGITS] = r17[LOGITS].replace(
        "        if aux_hidden_states is not None:\n",
        "        if isinstance(aux_hidden_states, torch.Tensor):\n"
        "            return hidden_states, aux_hidden_states\n"
        "        if aux_hidden_states is not None:\n",
    )
    r17[DSV2] = (
        r17[DSV2]
        .replace("        aux_hidden_states = []\n",
                 "        aux_hidden_states = AuxHiddenStatePacker(\n"
                 "            len(self.layers_to_capture)\n        )\n")
        .replace("        hidden_states, _ = self.norm(hidden_states, residual)\n"
                 "        if len(aux_hidden_states) == 0:\n",
                 "        hidden_states, _ = self.norm(hidden_states, residual)\n"
                 "        if not len(aux_hidden_states):\n")
    )
    return {PIN: pin, "0.5.14": r14, "0.5.15": r15, "0.5.16rc1": r15, "0.5.17": r17}


def make_wheel(path: Path, version: str, files: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in sorted(files.items()):
            info = zipfile.ZipInfo(name, (2026, 6, 15, 0, 0, 0))
            info.external_attr = 0o100644 << 16
            zf.writestr(info, text)
        zf.writestr(f"sglang-{version}.dist-info/METADATA",
                    f"Metadata-Version: 2.4\nName: sglang\nVersion: {version}\n\n")


def wheel_name(version: str) -> str:
    return f"sglang-{version}-cp311-cp311-manylinux_2_34_x86_64.whl"


def run_git(cwd: Path, *args: str) -> str:
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "GIT_CONFIG_GLOBAL": "/dev/null",
           "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_DATE": "2026-07-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2026-07-01T00:00:00+0000"}
    return subprocess.run(
        ["git", "-c", "user.name=Dev", "-c", "user.email=dev@example.invalid", *args],
        cwd=cwd, check=True, capture_output=True, text=True, env=env,
    ).stdout


def write_tree(dest: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = dest / "python" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def make_series(root: Path, series=SERIES, probes: bool = True) -> list[str]:
    """Write patches/NNNN-*.patch + patches/series built with git format-patch."""
    work = root / "build" / ".fixture-series"
    work.mkdir(parents=True)
    files = pin_files()
    write_tree(work, files)
    run_git(work, "init", "-q")
    run_git(work, "add", "-A")
    run_git(work, "commit", "-q", "-m", "pin")
    run_git(work, "tag", "base")
    for pid, subject, fwd, drop, edits in series:
        files = apply_edits(files, edits)
        write_tree(work, files)
        run_git(work, "add", "-A")
        trailers = (f"Patch-Id: {pid}\nOrigin: new\nForwarded: {fwd}\n"
                    f"Upstream-Status: test fixture\nDrop-In: {drop}\n")
        if probes:
            trailers += f"Upstream-Probe: {pid}\n"
        run_git(work, "commit", "-q", "-m", f"{subject}\n\nWhy: fixture for {pid}.\n\n{trailers}")
    out = run_git(work, "format-patch", "--zero-commit", "--no-signature", "--full-index",
                  "-o", str(root / "patches"), "base..HEAD")
    names = [Path(x).name for x in out.split()]
    (root / "patches" / "series").write_text("# fixture series\n" + "\n".join(names) + "\n")
    import shutil

    shutil.rmtree(work)
    return names


def make_root(root: Path, versions=None) -> dict[str, Path]:
    """Repo root with pin.json, cached release wheels and the fixture series."""
    rels = release_files()
    versions = versions or list(rels)
    cache = root / ".cache" / "pypi"
    wheels = {}
    for v in versions:
        w = cache / wheel_name(v)
        make_wheel(w, v, rels[v])
        wheels[v] = w
    (root / "patches").mkdir(parents=True, exist_ok=True)
    pin = {
        "package": "sglang", "version": PIN, "released": "2026-06-15",
        "git": {"url": "http://127.0.0.1:9/sglang.git", "tag": f"v{PIN}", "commit": "0" * 40},
        "wheels": {wheel_name(PIN): {"sha256": hashlib.sha256(wheels[PIN].read_bytes()).hexdigest()}},
        "source_tree_sha256": "TO-BE-COMPUTED",
    }
    (root / "patches" / "pin.json").write_text(json.dumps(pin, indent=2) + "\n")
    make_series(root)
    return wheels


class Index:
    """A PEP 691 JSON simple index over HTTP serving ``wheels`` ({version: path})."""

    def __init__(self, wheels: dict[str, Path], sha_override: dict[str, str] | None = None):
        self.wheels = wheels
        self.sha_override = sha_override or {}
        self.requests: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):  # noqa: D401
                pass

            def do_GET(self):  # noqa: N802
                outer.requests.append(self.path)
                if self.path.rstrip("/").endswith("/simple/sglang"):
                    files = []
                    for v, p in outer.wheels.items():
                        data = p.read_bytes()
                        files.append({
                            "filename": p.name, "url": f"../../files/{p.name}",
                            "hashes": {"sha256": outer.sha_override.get(v, hashlib.sha256(data).hexdigest())},
                            "size": len(data), "yanked": False,
                        })
                    body = json.dumps({"meta": {"api-version": "1.1"}, "name": "sglang",
                                       "versions": sorted(outer.wheels), "files": files}).encode()
                    ctype = "application/vnd.pypi.simple.v1+json"
                else:
                    name = self.path.rsplit("/", 1)[-1]
                    match = [p for p in outer.wheels.values() if p.name == name]
                    if not match:
                        self.send_error(404)
                        return
                    body = match[0].read_bytes()
                    ctype = "application/octet-stream"
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.srv.server_address[1]}/simple"

    def __enter__(self) -> "Index":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.srv.shutdown()
        self.srv.server_close()


@contextlib.contextmanager
def served_root(tmp_path, monkeypatch):
    """A fixture repo root (pin + series) with its wheels served by a local index;
    HARNESS_ROOT / HARNESS_INDEX_URL point at them. Yields (root, wheels)."""
    root = tmp_path / "repo"
    root.mkdir()
    wheels = make_root(root)
    monkeypatch.setenv("HARNESS_ROOT", str(root))
    monkeypatch.setenv("HARNESS_NET_TIMEOUT", "5")
    monkeypatch.delenv("HARNESS_CACHE", raising=False)
    with Index(wheels) as idx:
        monkeypatch.setenv("HARNESS_INDEX_URL", idx.url)
        yield root, wheels


# The four probes the synthetic fixture series exercises (capture-gather-scattered has
# its own fixture in test_upstream.py).
FIXTURE_PROBES = ["comm-readonly-residual", "dsv2-capture-after-allreduce", "aux-packer",
                  "dsv2-capture-final-layer"]
