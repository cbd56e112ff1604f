"""The doctor's report as a table for the terminal (stdlib only)."""

from __future__ import annotations

from harness.doctor.verdict import Report, describe_change


def _term(m) -> str:
    if m is None:
        return "-"
    if m.term is None:
        return f"? (closest {m.best.key()} {m.error:.1g})"
    return m.term.key()


def _trained(m) -> str:
    if m is None:
        return "-"
    head = _term(m)
    runner = f"; {m.runner_up.key()} {m.runner_up_error:.1g}" if m.runner_up is not None else ""
    return f"{head} ({m.error:.1g}{runner})"


def _grid(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def table(report: Report) -> str:
    t, d = report.target, report.draft
    lines = [
        f"target  {t.path}: {t.family.name} ({', '.join(t.config.get('architectures') or [])}), "
        f"{t.layers} layers, hidden {t.hidden}; served in {report.served_dtype or '?'} on SGLang "
        f"{report.base} + this series",
        f"draft   {d.path}: {d.method}, ids {d.ids if d.ids is not None else 'none (default)'}"
        + (f" from {d.ids_key}" if d.ids_key else "")
        + (f", {', '.join(f'{k}={v}' for k, v in d.settings.items())}" if d.settings else ""),
    ]
    s = report.served
    if s.resolved:
        lines.append(f"served  layers_to_capture {s.layers_to_capture}, final_layer_capture "
                     f"{s.resolved.get('final_layer_capture')}, deepstack_capture "
                     f"{s.resolved.get('deepstack_capture') or 'model default'}")
    if s.refused:
        lines.append(f"served  REFUSED at start-up: {s.refused}")
    if report.trained is not None:
        tr = report.trained
        lines.append(f"trained {len(tr.files)} file(s), {tr.rows} rows, {tr.dtype}"
                     + (f", {tr.image_rows} image rows" if tr.image_rows else ""))
    lines.append("")
    rows = [["slot", "id", "this server feeds", f"pristine {report.base}", "vLLM",
             "trained on (error; runner-up)", "verdict"]]
    for sl in report.slots:
        rows.append([str(sl.slot), "-" if sl.id is None else str(sl.id), _term(sl.serves), sl.pristine or "-",
                     sl.vllm or "-", _trained(sl.trained), sl.verdict.upper() if sl.verdict == "mismatch"
                     else sl.verdict])
    lines += _grid(rows)
    notes = [f"slot {sl.slot}: {sl.why}" for sl in report.slots if sl.why]
    fixes: dict[str, list[int]] = {}
    for sl in report.slots:
        if sl.fix:
            fixes.setdefault(sl.fix, []).append(sl.slot)
    for fix, slots in fixes.items():
        which = "every mismatched slot" if len(fixes) == 1 and len(slots) > 1 else \
            f"slot{'s' if len(slots) > 1 else ''} {', '.join(map(str, slots))}"
        notes.append(f"fix for {which}: {fix}")
    if notes:
        lines += [""] + notes
    if report.findings:
        lines.append("")
        for f in report.findings:
            lines.append(f"{f.severity}: {f.what}" + (f"\n    fix: {f.fix}" if f.fix else ""))
    if report.conventions:
        lines += ["", "conventions in the features: "
                  + ", ".join(f"{k}={v}" for k, v in sorted(report.conventions.items()))]
    if report.change:
        lines += ["", f"the one change: {describe_change(report.change)}"]
    lines += ["", f"verdict: {report.verdict.upper()}"]
    return "\n".join(lines)
