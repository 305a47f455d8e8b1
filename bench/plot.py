"""A small SVG line chart for the benchmarks (no plotting dependency): throughput and p99 against concurrency."""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

WIDTH, HEIGHT = 420, 300
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 30, 46
COLOURS = {"sqlite": "#1f77b4", "mariadb": "#d62728"}


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    magnitude = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * magnitude:
            return step * magnitude
    return 10 * magnitude


def _panel(x0: float, title: str, unit: str, series: list[tuple[str, str, bool, list[tuple[float, float]]]],
           xs: list[float], log_y: bool) -> list[str]:
    """One chart at horizontal offset ``x0``; x is log2(concurrency)."""
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    values = [y for *_, pts in series for _, y in pts if y > 0]
    lo, hi = (min(values, default=1.0), max(values, default=1.0))
    if log_y:
        y_lo, y_hi = 10 ** math.floor(math.log10(lo)), 10 ** math.ceil(math.log10(hi))
        if y_hi <= y_lo:
            y_hi = y_lo * 10
    else:
        y_lo, y_hi = 0.0, _nice_max(hi)
    x_lo, x_hi = math.log2(min(xs)), math.log2(max(xs))
    span_x = (x_hi - x_lo) or 1.0

    def px(x: float) -> float:
        return x0 + LEFT + (math.log2(x) - x_lo) / span_x * w

    def py(y: float) -> float:
        if log_y:
            frac = (math.log10(max(y, y_lo)) - math.log10(y_lo)) / (math.log10(y_hi) - math.log10(y_lo))
        else:
            frac = (y - y_lo) / (y_hi - y_lo)
        return TOP + h - frac * h

    out = [f'<text x="{x0 + LEFT + w / 2:.0f}" y="18" text-anchor="middle" font-weight="bold">{escape(title)}</text>',
           f'<rect x="{x0 + LEFT}" y="{TOP}" width="{w}" height="{h}" fill="none" stroke="#888"/>']
    for x in xs:
        out.append(f'<line x1="{px(x):.1f}" y1="{TOP + h}" x2="{px(x):.1f}" y2="{TOP + h + 4}" stroke="#888"/>')
        out.append(f'<text x="{px(x):.1f}" y="{TOP + h + 16}" text-anchor="middle">{x:g}</text>')
    out.append(f'<text x="{x0 + LEFT + w / 2:.0f}" y="{HEIGHT - 8}" text-anchor="middle">concurrency</text>')
    ticks = [y_lo * 10**k for k in range(round(math.log10(y_hi / y_lo)) + 1)] if log_y else [
        y_hi * k / 4 for k in range(5)]
    for y in ticks:
        out.append(f'<line x1="{x0 + LEFT}" y1="{py(y):.1f}" x2="{x0 + LEFT + w}" y2="{py(y):.1f}" '
                   f'stroke="#ddd"/>')
        out.append(f'<text x="{x0 + LEFT - 4}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    out.append(f'<text transform="translate({x0 + 14},{TOP + h / 2:.0f}) rotate(-90)" text-anchor="middle">'
               f'{escape(unit)}</text>')
    for _label, colour, dashed, pts in series:
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        dash = ' stroke-dasharray="5,4"' if dashed else ""
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        out.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{colour}"/>' for x, y in pts)
    return out


def concurrency_svg(points: dict[str, list[dict[str, float]]], *, note: str = "") -> str:
    """Two panels (throughput, p99), a solid line per backend for the command path and a dashed one for the
    bare driver. ``points[backend]`` holds dicts with concurrency, cps, p99, bare_cps, bare_p99."""
    xs = sorted({p["concurrency"] for pts in points.values() for p in pts})
    rate, p99 = [], []
    for backend, pts in points.items():
        colour = COLOURS.get(backend, "#2ca02c")
        rate.append((f"{backend} command path", colour, False, [(p["concurrency"], p["cps"]) for p in pts]))
        rate.append((f"{backend} bare driver", colour, True, [(p["concurrency"], p["bare_cps"]) for p in pts]))
        p99.append((f"{backend} command path", colour, False, [(p["concurrency"], p["p99"]) for p in pts]))
        p99.append((f"{backend} bare driver", colour, True, [(p["concurrency"], p["bare_p99"]) for p in pts]))
    body = _panel(0, "throughput", "transactions or commands / s", rate, xs, log_y=False)
    body += _panel(WIDTH, "p99 latency", "ms (log scale)", p99, xs, log_y=True)
    legend_y = HEIGHT + 14
    for i, (label, colour, dashed, _) in enumerate(rate):
        x = 20 + (i % 4) * 205
        y = legend_y + (i // 4) * 18
        dash = ' stroke-dasharray="5,4"' if dashed else ""
        body.append(f'<line x1="{x}" y1="{y - 4}" x2="{x + 24}" y2="{y - 4}" stroke="{colour}" stroke-width="2"'
                    f"{dash}/>")
        body.append(f'<text x="{x + 30}" y="{y}">{escape(label)}</text>')
    rows = (len(rate) + 3) // 4
    total_h = legend_y + rows * 18 + (18 if note else 0)
    if note:
        body.append(f'<text x="20" y="{total_h - 6}" fill="#555">{escape(note)}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * WIDTH}" height="{total_h}" '
            f'viewBox="0 0 {2 * WIDTH} {total_h}" font-family="sans-serif" font-size="11">'
            f'<rect width="100%" height="100%" fill="white"/>' + "".join(body) + "</svg>\n")
