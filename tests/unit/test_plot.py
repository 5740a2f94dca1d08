"""The SVG chart used by run folders and report cards."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from opencomposer.core.plot import chart


def test_lines_legend_and_non_finite_points():
    svg = chart({"a<b": [(1, 2.0), (2, float("nan")), (3, 1.0)], "c": [(1, 3.0), (3, 0.5)]}, "step", "loss")
    root = ET.fromstring(svg)                                   # well-formed XML (names are escaped)
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    assert len(lines) == 2
    first = [tuple(map(float, p.split(","))) for p in lines[0].get("points").split()]
    assert len(first) == 2                                      # the NaN point is left out
    assert first[0][1] < first[1][1]                            # y = 2 is drawn above y = 1 (SVG y grows down)
    assert "a&lt;b" in svg and ">c<" in svg                     # a legend entry per series


def test_dots_with_labels_on_a_log_axis():
    svg = chart({"only": [(1e3, 0.5), (1e6, 0.25)]}, "FLOPs", "loss", log_x=True, lines=False, labels=True)
    xs = [float(x) for x in re.findall(r'<circle cx="([0-9.]+)"', svg)]
    assert len(xs) == 2 and xs[0] < xs[1]
    assert ">0.500<" in svg and ">0.250<" in svg and "polyline" not in svg
    assert "only" not in svg                                    # one series needs no legend
