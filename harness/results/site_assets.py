"""The leaderboard site's stylesheet and script (:mod:`.site`), inlined in every page so a
page opens from disk or any static host with nothing fetched.

The script (no library): a click on a board's or table's header sorts its rows by that
column (numbers by value, a cell's ``data-sort`` first; empty cells last; a second click
reverses); the filter box keeps the rows holding every word typed; the checkbox shows the
``unsupported`` and ``unavailable`` cells and the columns and rows made only of them; a
link to a case's replay commands opens the section that holds them.

A page carries each on one line (:func:`one_line`), as it carries the rest of its markup.
That is safe for the stylesheet, where a line break is a space, and for the script because
each of its lines ends a statement or opens or closes a block: no ``//`` comment, no
statement left to automatic semicolon insertion.
"""

CSS = """
:root{--ink:#1d2330;--muted:#5d6675;--line:#dfe3ea;--bg:#f6f7f9;--card:#fff;
--accent:#2b59c3;--fail:#c62828;--fail-bg:#fdecea;--warn-bg:#fff4d6;--na:#eef0f3;--na-ink:#9aa1ab}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,
sans-serif;color:var(--ink);background:var(--bg)}
header.top{background:#18202f;color:#fff;padding:14px 28px;display:flex;align-items:baseline;
gap:18px;flex-wrap:wrap}
header.top a{color:#c9d6ff;text-decoration:none}
header.top h1{font-size:20px;margin:0;font-weight:600}
header.top .sub{color:#aab4c8;font-size:13px}
main{padding:18px 28px 40px;max-width:none}
section.card{background:var(--card);border:1px solid var(--line);border-radius:8px;
padding:14px 18px;margin:0 0 18px}
h2{font-size:17px;margin:0 0 10px}
h3{font-size:15px;margin:14px 0 6px}
p.note{color:var(--muted);font-size:12.5px;margin:4px 0 10px;max-width:110ch}
p.warn{color:var(--fail);font-weight:600}
dl.env{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:3px 18px;
margin:0;font-size:13px}
dl.env div{display:flex;gap:6px}
dl.env dt{color:var(--muted);min-width:120px}
dl.env dd{margin:0;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12.5px}
.controls{display:flex;gap:18px;align-items:center;flex-wrap:wrap;margin:0 0 10px}
.controls input[type=search]{padding:6px 10px;border:1px solid var(--line);border-radius:6px;
width:300px;font:inherit}
.legend{display:flex;gap:10px;flex-wrap:wrap;font-size:12px;color:var(--muted);align-items:center}
.legend span.sw{display:inline-block;width:22px;height:12px;border-radius:3px;
vertical-align:middle;margin-right:4px;border:1px solid rgba(0,0,0,.08)}
.scroll{overflow:auto;max-height:78vh;border:1px solid var(--line);border-radius:6px}
table.board,table.data{border-collapse:separate;border-spacing:0;font-size:12.5px;background:#fff}
table.board th,table.board td,table.data th,table.data td{border-bottom:1px solid var(--line);
border-right:1px solid var(--line);padding:4px 7px;white-space:nowrap}
table.board thead th,table.data thead th{position:sticky;top:0;background:#f0f2f6;z-index:2;
cursor:pointer;user-select:none;font-weight:600;text-align:left;vertical-align:bottom}
table.board thead th.impl{writing-mode:vertical-rl;transform:rotate(180deg);
padding:8px 4px;text-align:left;min-width:0}
table.board td.group,table.board thead th:first-child{position:sticky;left:0;z-index:1}
table.board thead th:first-child{z-index:3}
table.board thead th .chip{display:inline-block;width:9px;height:9px;border-radius:50%;
margin-bottom:5px}
th[aria-sort=ascending]::after{content:" \\25B2";font-size:9px}
th[aria-sort=descending]::after{content:" \\25BC";font-size:9px}
table.board td.param{color:#2c3445;background:#fafbfc;padding:4px 6px}
table.board td.group{font-weight:600;white-space:normal;min-width:9em;max-width:15em}
table.board td.cell{text-align:right;min-width:66px}
td.cell .t{display:block;font-weight:600;font-variant-numeric:tabular-nums}
td.cell .s{display:block;font-size:10.5px;opacity:.85;font-variant-numeric:tabular-nums}
td.cell a.rp{color:inherit;text-decoration:none;opacity:.55;font-size:10px;margin-left:3px}
td.pass.best{outline:2px solid #0b3d14;outline-offset:-2px}
td.interp{background:#eef3fb;color:#33507a}
td.fail,td.bad{background:var(--fail-bg);color:var(--fail);box-shadow:inset 3px 0 0 var(--fail)}
td.herr{background:var(--warn-bg);color:#8a5a00}
td.na{background:var(--na);color:var(--na-ink);font-size:11px}
body:not(.show-na) td.na{color:transparent}
body:not(.show-na) .na-col,body:not(.show-na) tr.na-row{display:none}
table.data td{text-align:right;font-variant-numeric:tabular-nums}
table.data td:first-child{text-align:left}
figure{margin:10px 0 18px}
figure img{max-width:100%;border:1px solid var(--line);border-radius:6px;background:#fff}
figcaption{font-size:12.5px;color:var(--muted);margin-top:4px}
details summary{cursor:pointer;font-weight:600;margin:6px 0}
code{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px;background:#f2f4f8;
padding:1px 4px;border-radius:4px}
ul.reasons{font-size:12.5px;color:#333;max-width:140ch}
table.index{border-collapse:collapse;font-size:13.5px;width:100%}
table.index th,table.index td{text-align:left;padding:7px 10px;border-bottom:1px solid var(--line)}
table.index th{background:#f0f2f6}
table.index td:first-child{white-space:nowrap}
"""

JS = """
(function () {
  function key(td) {
    if (!td) return null;
    var v = td.getAttribute('data-sort');
    if (v === null) v = td.textContent.trim();
    if (v === '') return null;
    var n = Number(v);
    return isNaN(n) ? v.toLowerCase() : n;
  }
  function sortBy(table, index, th) {
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var up = th.getAttribute('aria-sort') !== 'ascending';
    rows.sort(function (a, b) {
      var x = key(a.cells[index]), y = key(b.cells[index]);
      if (x === null && y === null) return 0;
      if (x === null) return 1;
      if (y === null) return -1;
      if (typeof x !== typeof y) { x = String(x); y = String(y); }
      return (x < y ? -1 : x > y ? 1 : 0) * (up ? 1 : -1);
    });
    rows.forEach(function (row) { body.appendChild(row); });
    Array.prototype.forEach.call(th.parentNode.cells, function (c) {
      c.removeAttribute('aria-sort');
    });
    th.setAttribute('aria-sort', up ? 'ascending' : 'descending');
  }
  document.querySelectorAll('table.board, table.data').forEach(function (table) {
    if (!table.tHead) return;
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, i) {
      th.addEventListener('click', function () { sortBy(table, i, th); });
    });
  });
  document.querySelectorAll('input.filter').forEach(function (box) {
    var table = document.getElementById(box.getAttribute('data-table'));
    box.addEventListener('input', function () {
      var words = box.value.toLowerCase().split(/\\s+/).filter(Boolean);
      Array.prototype.forEach.call(table.tBodies[0].rows, function (row) {
        var text = (row.getAttribute('data-text') || row.textContent).toLowerCase();
        row.hidden = !words.every(function (w) { return text.indexOf(w) >= 0; });
      });
    });
  });
  document.querySelectorAll('input.show-na').forEach(function (box) {
    box.addEventListener('change', function () {
      document.body.classList.toggle('show-na', box.checked);
    });
  });
  function openTarget() {
    var id = decodeURIComponent(location.hash.slice(1));
    var target = id && document.getElementById(id);
    if (!target) return;
    for (var node = target; node; node = node.parentElement) {
      if (node.tagName === 'DETAILS') node.open = true;
    }
    target.scrollIntoView({block: 'center'});
  }
  window.addEventListener('hashchange', openTarget);
  openTarget();
})();
"""


def one_line(asset: str) -> str:
    """``asset`` (:data:`CSS` or :data:`JS`) with each line stripped and the non-blank
    ones joined by one space."""
    return " ".join(line.strip() for line in asset.splitlines() if line.strip())
