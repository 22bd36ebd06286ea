"""``/debug/kv``: one self-contained HTML page drawing every physical KV block as a cell.

No external assets: CSS and JS are inline. The page starts from the block map inlined in it
(so it draws on load, even for ``chromium --dump-dom``) and then refreshes from
``/debug/kv.json`` every second. Cells: grey free, blue in use (darker = higher ref count),
amber evictable (cached, ref 0); hover shows the block's owners and prefix hash.
"""

from __future__ import annotations

import json
from typing import Any

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pagekv KV blocks</title>
<style>
body { font: 13px system-ui, sans-serif; margin: 16px; color: #222; }
#grid { display: grid; grid-template-columns: repeat(auto-fill, 14px); gap: 2px; }
.cell { width: 14px; height: 14px; border-radius: 2px; }
.free { background: #e4e4e4; }
.evictable { background: #f0b43c; }
.legend span { display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px;
  vertical-align: middle; border-radius: 2px; }
#info { min-height: 3em; white-space: pre; font-family: monospace; margin: 8px 0; }
table { border-collapse: collapse; margin-top: 8px; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: left; font-family: monospace; }
</style></head>
<body>
<h2>pagekv: KV block map <small id="model"></small></h2>
<div class="legend">
  <span class="free"></span>free <span style="background:#2f6fd0"></span>in use
  (darker = more references) <span class="evictable"></span>evictable (cached, ref 0)
  <label style="margin-left:16px"><input type="checkbox" id="pause"> pause</label>
</div>
<p id="summary"></p>
<div id="grid"></div>
<div id="info">hover a block</div>
<h3>Swapped-out requests</h3><ul id="swapped"></ul>
<h3>Requests on the device</h3>
<table><thead><tr><th>request</th><th>blocks</th><th>block table</th></tr></thead>
<tbody id="requests"></tbody></table>
<script id="initial" type="application/json">__INITIAL__</script>
<script>
"use strict";
const grid = document.getElementById("grid");
function shade(ref) {
  const light = Math.max(25, 68 - 9 * (Math.min(ref, 6) - 1));
  return "hsl(215, 65%, " + light + "%)";
}
function describe(b) {
  return "block " + b.id + "  " + b.state + "  ref " + b.ref_count +
    "\\nowners: " + (b.owners.length ? b.owners.join(", ") : "-") +
    "\\nhash: " + (b.hash || "-");
}
function drawCells(blocks) {
  while (grid.children.length > blocks.length) grid.lastChild.remove();
  while (grid.children.length < blocks.length) {
    const cell = document.createElement("div");
    cell.addEventListener("mouseenter", () => {
      document.getElementById("info").textContent = cell.title;
    });
    grid.appendChild(cell);
  }
  blocks.forEach((b, i) => {
    const cell = grid.children[i];
    cell.className = "cell " + b.state;
    cell.dataset.block = b.id;
    cell.dataset.state = b.state;
    cell.dataset.ref = b.ref_count;
    cell.style.background = b.state === "in_use" ? shade(b.ref_count) : "";
    cell.title = describe(b);
  });
}
function fillList(id, rows) {
  const el = document.getElementById(id);
  el.replaceChildren(...rows);
}
function draw(data) {
  document.getElementById("model").textContent = data.model || "";
  drawCells(data.blocks);
  const count = s => data.blocks.filter(b => b.state === s).length;
  const s = data.stats || {};
  document.getElementById("summary").textContent = data.num_blocks + " blocks x " +
    data.block_size + " tokens: " + count("free") + " free, " + count("in_use") +
    " in use, " + count("evictable") + " evictable; running " + (s.num_running ?? "?") +
    ", waiting " + (s.num_waiting ?? "?") + ", swapped " + (s.num_swapped ?? "?") +
    "  (updated " + new Date().toLocaleTimeString() + ")";
  fillList("swapped", Object.entries(data.swapped).map(([rid, host]) => {
    const li = document.createElement("li");
    li.textContent = rid + ": " + host.length + " host blocks";
    return li;
  }));
  fillList("requests", Object.entries(data.requests).map(([rid, table]) => {
    const tr = document.createElement("tr");
    for (const text of [rid, String(table.length), table.join(" ")]) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.appendChild(td);
    }
    return tr;
  }));
}
async function refresh() {
  if (document.getElementById("pause").checked) return;
  try {
    const response = await fetch("kv.json", {cache: "no-store"});
    if (response.ok) draw(await response.json());
  } catch (e) {
    document.getElementById("info").textContent = "refresh failed: " + e;
  }
}
draw(JSON.parse(document.getElementById("initial").textContent));
setInterval(refresh, 1000);
</script>
</body></html>
"""


def render_kv_page(data: dict[str, Any]) -> str:
    """The page with ``data`` (a ``/debug/kv.json`` body) inlined as its first frame."""
    # "</" inside a <script> element would end it early; "<\\/" is the same JSON string.
    inline = json.dumps(data).replace("</", "<\\/")
    return _PAGE.replace("__INITIAL__", inline)
