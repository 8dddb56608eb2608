"""The HTML/CSS/JS template of report/completions.html (filled by report/completions_view.py:
@TITLE@ with the escaped run name, @DATA@ with the escaped JSON). All data reaches the page
through textContent, never innerHTML, so completions are shown as text whatever they hold.

The page opens on the last step; it filters by step and by text (in prompts and completions, or
completions only), sorts by reward or advantage, and pages. The pure parts (sorting, matching,
the last step) are the `logic` script's CompletionsLogic, which tests run in QuickJS."""

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Completions: @TITLE@</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1em 2em; color: #222; }
#controls { position: sticky; top: 0; background: #fff; padding: .5em 0;
            border-bottom: 1px solid #ccc; }
#controls label { margin-right: 1em; }
table { border-collapse: collapse; width: 100%; margin-top: .5em; }
th, td { border-bottom: 1px solid #e4e4e4; padding: .3em .5em; vertical-align: top;
         text-align: left; font-size: 13px; }
th { background: #f4f4f4; position: sticky; top: 2.6em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.prompt td { background: #f0f4fa; border-top: 2px solid #9ab; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; font-size: 12.5px; }
summary { cursor: pointer; }
#note { color: #555; }
</style>
</head>
<body>
<h1>Completions: @TITLE@</h1>
<p id="note"></p>
<noscript>This page needs JavaScript to show the completions.</noscript>
<div id="controls">
<label>step <select id="step"></select></label>
<label>search <input id="search" type="search" placeholder="text in prompt or completion"></label>
<label><input id="only" type="checkbox"> in completions only</label>
<label>sort <select id="sort">
<option value="">prompt order</option>
<option value="reward:-1">reward, highest first</option>
<option value="reward:1">reward, lowest first</option>
<option value="advantage:-1">advantage, highest first</option>
<option value="advantage:1">advantage, lowest first</option></select></label>
<label>per page <select id="size">
<option>20</option><option>50</option><option>100</option></select></label>
<button id="prev" type="button">&larr; previous</button>
<span id="info"></span>
<button id="next" type="button">next &rarr;</button>
</div>
<table>
<thead><tr id="head"></tr></thead>
<tbody id="rows"></tbody>
</table>
<script type="application/json" id="data">@DATA@</script>
<script id="logic">
var CompletionsLogic = (function () {
  "use strict";
  function missing(x) { return x === null || x === undefined; }
  // rows ordered by "key:1" (lowest first) or "key:-1" (highest first), nulls last, ties in
  // their original order; "" keeps the order
  function sortRows(rows, order) {
    if (!order) { return rows.slice(); }
    var key = order.split(":")[0], direction = Number(order.split(":")[1]);
    return rows.map(function (r, i) { return [r, i]; }).sort(function (a, b) {
      var x = a[0][key], y = b[0][key];
      if (missing(x) || missing(y) || x === y) {
        return missing(x) === missing(y) ? a[1] - b[1] : (missing(x) ? 1 : -1);
      }
      return x < y ? -direction : direction;
    }).map(function (pair) { return pair[0]; });
  }
  function matches(row, prompt, step, query, completionsOnly) {
    query = query.toLowerCase();
    return (step === "" || String(row.step) === step) && (query === "" ||
      row.completion.toLowerCase().indexOf(query) >= 0 ||
      (!completionsOnly && prompt.toLowerCase().indexOf(query) >= 0));
  }
  function lastStep(rows) {
    return rows.reduce(function (last, r) { return Math.max(last, r.step); }, -Infinity);
  }
  return {sortRows: sortRows, matches: matches, lastStep: lastStep};
}());
</script>
<script>
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("data").textContent);
  var byId = function (id) { return document.getElementById(id); };
  var stepSelect = byId("step"), search = byId("search"), size = byId("size");
  var only = byId("only"), sort = byId("sort"), logic = CompletionsLogic;
  var body = byId("rows"), view = data.rows, page = 0;
  var columns = ["step", "reward"].concat(data.funcs,
                                           ["advantage", "length", "truncated", "completion"]);

  function element(tag, text, className) {
    var node = document.createElement(tag);
    if (text !== undefined) { node.textContent = text; }
    if (className) { node.className = className; }
    return node;
  }
  function number(x) {
    return x === null || x === undefined ? "null" : String(Math.round(x * 10000) / 10000);
  }
  function advantageColor(a) {
    if (a === null) { return ""; }
    var alpha = Math.min(Math.abs(a) / 2, 1) * 0.45;
    return a >= 0 ? "rgba(0,150,0," + alpha + ")" : "rgba(210,0,0," + alpha + ")";
  }
  function promptRow(r) {
    var tr = element("tr", undefined, "prompt"), td = element("td");
    var text = data.prompts[r.p], details = element("details"), summary = element("summary");
    td.colSpan = columns.length;
    summary.textContent = "step " + r.step + " \\u00b7 prompt " + r.prompt_id + ": " +
      text.slice(-160).replace(/\\s+/g, " ");
    details.appendChild(summary);
    details.appendChild(element("pre", text));
    td.appendChild(details);
    tr.appendChild(td);
    return tr;
  }
  function completionRow(r) {
    var tr = element("tr", undefined, "completion");
    tr.appendChild(element("td", String(r.step), "num"));
    tr.appendChild(element("td", number(r.reward), "num"));
    r.rewards.forEach(function (x) { tr.appendChild(element("td", number(x), "num")); });
    var adv = element("td", number(r.advantage), "num");
    adv.style.background = advantageColor(r.advantage);
    tr.appendChild(adv);
    var length = r.length === null || r.length === undefined ? "" : String(r.length);
    tr.appendChild(element("td", length, "num"));
    tr.appendChild(element("td", r.truncated ? "yes" : ""));
    var cell = element("td");
    cell.appendChild(element("pre", r.completion));
    tr.appendChild(cell);
    return tr;
  }
  function render() {
    var perPage = Number(size.value), pages = Math.max(1, Math.ceil(view.length / perPage));
    page = Math.min(page, pages - 1);
    while (body.firstChild) { body.removeChild(body.firstChild); }
    var last = null;
    view.slice(page * perPage, (page + 1) * perPage).forEach(function (r) {
      var key = r.step + "/" + r.p;
      if (key !== last) { body.appendChild(promptRow(r)); last = key; }
      body.appendChild(completionRow(r));
    });
    byId("info").textContent = "page " + (page + 1) + " of " + pages + " (" + view.length +
      " completions)";
    byId("prev").disabled = page === 0;
    byId("next").disabled = page >= pages - 1;
  }
  function applyFilter() {
    view = logic.sortRows(data.rows.filter(function (r) {
      return logic.matches(r, data.prompts[r.p], stepSelect.value, search.value, only.checked);
    }), sort.value);
    page = 0;
    render();
  }
  function setUp() {
    var counts = {}, steps = [];
    data.rows.forEach(function (r) {
      if (!(r.step in counts)) { counts[r.step] = 0; steps.push(r.step); }
      counts[r.step] += 1;
    });
    stepSelect.appendChild(new Option("all " + steps.length + " steps", ""));
    steps.forEach(function (s) {
      stepSelect.appendChild(new Option(s + " (" + counts[s] + ")", String(s)));
    });
    columns.forEach(function (c) { byId("head").appendChild(element("th", c)); });
    size.value = String(data.page_size);
    byId("note").textContent = data.rows.length === data.total ?
      data.total + " completions." :
      "Showing " + data.rows.length + " of " + data.total + " completions, sampled over every " +
      "step (all of them are in completions.jsonl).";
    stepSelect.addEventListener("change", applyFilter);
    search.addEventListener("input", applyFilter);
    only.addEventListener("change", applyFilter);
    sort.addEventListener("change", applyFilter);
    size.addEventListener("change", function () { page = 0; render(); });
    byId("prev").addEventListener("click", function () { page -= 1; render(); });
    byId("next").addEventListener("click", function () { page += 1; render(); });
    if (data.rows.length) { stepSelect.value = String(logic.lastStep(data.rows)); }
    applyFilter();   // opens on the last step
  }
  setUp();
}());
</script>
</body>
</html>
"""
