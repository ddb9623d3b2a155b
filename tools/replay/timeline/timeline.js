// The memory timeline page of cucache-replay (tools/replay/timeline.cpp embeds this file).
// Data: the JSON in #cucache-data (format cucache-timeline-1): per series min/max envelopes over
// "buckets" of consecutive events (at most 32768 buckets; one event each for smaller traces),
// device-call marks counted per bucket, and the reserved peak with what was alive at it.
//
// Downsampling: each series gets a pyramid of min/max levels (level k merges 2^k buckets). A
// pixel column covering buckets [a, b) shows the min and max over exactly those buckets, read
// from the pyramid in O(log n): the maximum of every run is kept, so the peak is never lost at
// any zoom (checked below against the peak the replay reported).
(function () {
  'use strict';
  var D = JSON.parse(document.getElementById('cucache-data').textContent);
  var B = D.buckets, N = D.events;

  // --- formatting -------------------------------------------------------------------------------
  var KiB = 1024, MiB = KiB * 1024, GiB = MiB * 1024;
  function human(b) {
    var a = Math.abs(b);
    if (a >= 1024 * GiB) return (b / (1024 * GiB)).toFixed(3) + ' TiB';
    if (a >= GiB) return (b / GiB).toFixed(3) + ' GiB';
    if (a >= MiB) return (b / MiB).toFixed(2) + ' MiB';
    if (a >= KiB) return (b / KiB).toFixed(1) + ' KiB';
    return b + ' B';
  }
  function grouped(n) { return String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ','); }
  function exact(b) { return grouped(b) + ' bytes'; }
  function timeOfDay(us) {
    if (us === undefined || us === null) return '';
    var s = Math.floor(us / 1e6), f = String(us % 1000000).padStart(6, '0');
    // % 24: a PyTorch snapshot times its entries in microseconds since the epoch (UTC).
    var h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60, sec = s % 60;
    return String(h).padStart(2, '0') + ':' + String(m).padStart(2, '0') + ':' + String(sec).padStart(2, '0') + '.' + f;
  }
  function text(id, t) { document.getElementById(id).textContent = t; }
  function bucketFirstEvent(b) { return Math.ceil(b * N / B); }  // first event of bucket b

  // --- series and their pyramids ---------------------------------------------------------------
  var METRIC_COLORS = { reserved: '#d62728', allocated: '#1f77b4', requested: '#2ca02c',
                        sleeping: '#9467bd' };
  var GROUP_COLORS = ['#444444', '#9467bd', '#ff7f0e', '#17becf', '#8c564b', '#e377c2', '#bcbd22', '#7f7f7f'];
  var METRIC_DASH = { reserved: [], allocated: [6, 3], requested: [2, 3], sleeping: [8, 4] };
  var series = D.series.map(function (s, i) {
    var g = Math.floor(i / 3);
    var levels = [{ lo: Float64Array.from(s.min), hi: Float64Array.from(s.max) }];
    while (levels[levels.length - 1].lo.length > 1) {
      var prev = levels[levels.length - 1], n = Math.ceil(prev.lo.length / 2);
      var lo = new Float64Array(n), hi = new Float64Array(n);
      for (var j = 0; j < n; ++j) {
        var k = 2 * j, k2 = Math.min(k + 1, prev.lo.length - 1);
        lo[j] = Math.min(prev.lo[k], prev.lo[k2]);
        hi[j] = Math.max(prev.hi[k], prev.hi[k2]);
      }
      levels.push({ lo: lo, hi: hi });
    }
    // The last series, "all" / "sleeping", is the device bytes sleeping tags gave back: drawn
    // with the totals (group 0), dashed.
    if (s.metric === 'sleeping') g = 0;
    return {
      group: s.group, metric: s.metric, groupIndex: g, levels: levels,
      color: g === 0 ? METRIC_COLORS[s.metric] : GROUP_COLORS[(g - 1) % GROUP_COLORS.length],
      dash: s.metric === 'sleeping' ? METRIC_DASH.sleeping : g === 0 ? [] : METRIC_DASH[s.metric],
      width: s.metric === 'reserved' ? 2 : 1.5,
      // The sleeping series is drawn and offered only when a tag slept (it is zero throughout
      // otherwise).
      slept: s.metric === 'sleeping' && s.max.some(function (v) { return v > 0; }),
      visible: g === 0 && (s.metric !== 'sleeping' || s.max.some(function (v) { return v > 0; }))
    };
  });
  // Min and max of series s over buckets [a, b): aligned power-of-two runs from the pyramid.
  function range(s, a, b) {
    var lo = Infinity, hi = -Infinity;
    while (a < b) {
      var k = 0;
      while (k + 1 < s.levels.length && a % (1 << (k + 1)) === 0 && a + (1 << (k + 1)) <= b) ++k;
      var L = s.levels[k], i = a >> k;
      if (L.lo[i] < lo) lo = L.lo[i];
      if (L.hi[i] > hi) hi = L.hi[i];
      a += 1 << k;
    }
    return [lo, hi];
  }

  // --- marks: counts per bucket, with prefix sums for any range ----------------------------------
  var marks = D.marks.map(function (m, i) {
    var prefix = new Float64Array(B + 1), dense = new Float64Array(B);
    for (var j = 0; j < m.buckets.length; ++j) dense[m.buckets[j]] += m.counts[j];
    for (var b = 0; b < B; ++b) prefix[b + 1] = prefix[b] + dense[b];
    var bad = /out of memory|refused/.test(m.name);
    return { name: m.name, total: m.total, prefix: prefix,
             color: bad ? '#c0392b' : /retry|reclaim|synchronize/.test(m.name) ? '#e67e22' : GROUP_COLORS[i % GROUP_COLORS.length] };
  });
  function markCount(m, a, b) { return m.prefix[Math.min(b, B)] - m.prefix[Math.max(a, 0)]; }

  // --- self-check: the envelope keeps the peak ---------------------------------------------------
  var peak = D.peak;
  var reservedAll = series[2];
  var top = reservedAll.levels[reservedAll.levels.length - 1].hi[0];
  if (N > 0 && top !== peak.reserved_bytes) {
    window.cucacheReportError('the reserved envelope tops at ' + top + ' bytes, the replay reported ' + peak.reserved_bytes);
  }

  // --- header and summary -----------------------------------------------------------------------
  text('trace-name', D.trace);
  document.title = 'cucache memory timeline: ' + D.trace;
  text('subtitle', grouped(N) + ' events, ' + D.streams.length + ' stream' + (D.streams.length === 1 ? '' : 's') +
       ' (' + D.streams.join(', ') + '); backend ' + D.backend + '; config ' + (D.config || '(defaults)') +
       (B < N ? '; stored as ' + grouped(B) + ' buckets of ~' + (N / B).toFixed(1) + ' events (min/max kept)' : ''));
  var peakEl = document.getElementById('peak-reserved');
  peakEl.setAttribute('data-bytes', String(peak.reserved_bytes));
  peakEl.textContent = exact(peak.reserved_bytes);
  peakEl.title = human(peak.reserved_bytes);
  text('peak-where', human(peak.reserved_bytes) + ' at event ' + grouped(peak.event) +
       (peak.line ? ' (trace line ' + grouped(peak.line) + ')' : ''));
  var pa = document.getElementById('peak-allocated');
  pa.setAttribute('data-bytes', String(peak.allocated_bytes));
  pa.textContent = human(peak.allocated_bytes);
  pa.title = exact(peak.allocated_bytes);
  var pr = document.getElementById('peak-requested');
  pr.setAttribute('data-bytes', String(peak.requested_bytes));
  pr.textContent = human(peak.requested_bytes);
  pr.title = exact(peak.requested_bytes);
  var T = D.totals;
  if (D.expandable) {
    text('device-calls', grouped(T.vm_create_calls) + ' create / ' + grouped(T.vm_map_calls) + ' map');
    text('device-calls-note', grouped(T.vm_unmap_calls) + ' unmap, ' + grouped(T.vm_release_calls) +
         ' release; ' + grouped(T.oom_count) + ' out of memory');
  } else {
    text('device-calls', grouped(T.device_alloc_calls) + ' cudaMalloc');
    text('device-calls-note', grouped(T.device_free_calls) + ' cudaFree; ' + grouped(T.oom_count) + ' out of memory');
  }
  text('format', D.format);

  // --- series picker ----------------------------------------------------------------------------
  // One row per group: its name in the first column, then one column per metric, always the same
  // column for a metric (the "all" group alone has a fifth, sleeping, and only when a tag slept).
  var PICKER_COLUMN = { requested: 2, allocated: 3, reserved: 4, sleeping: 5 };
  var picker = document.getElementById('series-picker');
  var offered = series.filter(function (s) { return s.metric !== 'sleeping' || s.slept; });
  var groups = [];
  offered.forEach(function (s) { if (groups.indexOf(s.group) < 0) groups.push(s.group); });
  groups.forEach(function (g) {
    var head = document.createElement('div');
    head.className = 'group';
    head.style.gridColumn = '1';
    head.textContent = g;
    picker.appendChild(head);
    offered.filter(function (s) { return s.group === g; }).forEach(function (s) {
      var label = document.createElement('label');
      label.setAttribute('data-metric', s.metric);
      label.style.gridColumn = String(PICKER_COLUMN[s.metric] || 2);
      var box = document.createElement('input');
      box.type = 'checkbox';
      box.checked = s.visible;
      box.addEventListener('change', function () { s.visible = box.checked; draw(); });
      var sw = document.createElement('span');
      sw.className = 'swatch';
      sw.style.borderTopColor = s.color;
      sw.style.borderTopStyle = s.dash.length ? (s.metric === 'requested' ? 'dotted' : 'dashed') : 'solid';
      label.appendChild(box);
      label.appendChild(sw);
      label.appendChild(document.createTextNode(s.metric));
      picker.appendChild(label);
    });
  });
  // The layout holds: every metric's boxes line up in one column, whatever the groups (a box out
  // of its column is reported in #errors, which the browser test checks).
  (function () {
    var left = {};
    Array.prototype.forEach.call(picker.querySelectorAll('label'), function (l) {
      var m = l.getAttribute('data-metric'), x = l.offsetLeft;
      if (m in left && left[m] !== x) console.error('series picker: the ' + m + ' boxes are not in one column');
      left[m] = x;
    });
  })();

  // --- the chart --------------------------------------------------------------------------------
  var canvas = document.getElementById('chart');
  var ctx = canvas.getContext('2d');
  var tooltip = document.getElementById('tooltip');
  var view = { a: 0, b: B };  // visible buckets, fractional
  var hoverX = null;
  var M = { left: 112, right: 16, top: 14, bottom: 28 };
  var LANE = 13;
  function layout() {
    var dpr = window.devicePixelRatio || 1;
    var w = canvas.clientWidth, h = canvas.clientHeight;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    var lanes = marks.length * LANE + (marks.length ? 10 : 0);
    return { w: w, h: h, x0: M.left, x1: w - M.right, y0: M.top, y1: h - M.bottom - lanes, lanes: lanes };
  }
  function columnBuckets(L, x) {  // buckets under pixel column x (integer), at least one
    var span = (view.b - view.a) / (L.x1 - L.x0);
    var a = Math.floor(view.a + (x - L.x0) * span);
    var b = Math.floor(view.a + (x + 1 - L.x0) * span);
    a = Math.max(0, Math.min(B - 1, a));
    b = Math.max(a + 1, Math.min(B, b));
    return [a, b];
  }
  function niceStep(max, n) {
    var raw = max / n, unit = [1, KiB, MiB, GiB].filter(function (u) { return max >= u; }).pop() || 1;
    var x = raw / unit, p = Math.pow(10, Math.floor(Math.log10(x))), m = x / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p * unit;
  }
  function draw() {
    var L = layout();
    ctx.clearRect(0, 0, L.w, L.h);
    var cols = Math.max(1, Math.floor(L.x1 - L.x0));
    var vis = series.filter(function (s) { return s.visible; });
    // Envelopes per column for the visible series, and the y range.
    var env = vis.map(function () { return { lo: new Float64Array(cols), hi: new Float64Array(cols) }; });
    var ymax = 0;
    for (var c = 0; c < cols; ++c) {
      var r = columnBuckets(L, L.x0 + c);
      for (var i = 0; i < vis.length; ++i) {
        var v = range(vis[i], r[0], r[1]);
        env[i].lo[c] = v[0];
        env[i].hi[c] = v[1];
        if (v[1] > ymax) ymax = v[1];
      }
    }
    if (ymax <= 0) ymax = 1;
    var step = niceStep(ymax, 6);
    ymax = Math.ceil(ymax * 1.04 / step) * step;
    function Y(v) { return L.y1 - (v / ymax) * (L.y1 - L.y0); }
    // Grid and y labels.
    ctx.font = '11px system-ui, sans-serif';
    ctx.fillStyle = '#5c6678';
    ctx.strokeStyle = '#e6e9ef';
    ctx.lineWidth = 1;
    ctx.textAlign = 'right';
    ctx.textBaseline = 'middle';
    for (var yv = 0; yv <= ymax + 1e-9; yv += step) {
      var yy = Math.round(Y(yv)) + 0.5;
      ctx.beginPath(); ctx.moveTo(L.x0, yy); ctx.lineTo(L.x1, yy); ctx.stroke();
      ctx.fillText(human(yv), L.x0 - 6, yy);
    }
    // x labels: event indices.
    ctx.textAlign = 'center';
    ctx.textBaseline = 'top';
    var ev0 = view.a * N / B, ev1 = view.b * N / B;
    var xs = Math.pow(10, Math.floor(Math.log10(Math.max(1, (ev1 - ev0) / 6))));
    if ((ev1 - ev0) / xs > 12) xs *= 5; else if ((ev1 - ev0) / xs > 6) xs *= 2;
    for (var e = Math.ceil(ev0 / xs) * xs; e <= ev1; e += xs) {
      var xx = L.x0 + (e - ev0) / (ev1 - ev0) * (L.x1 - L.x0);
      ctx.strokeStyle = '#eef0f4';
      ctx.beginPath(); ctx.moveTo(Math.round(xx) + 0.5, L.y0); ctx.lineTo(Math.round(xx) + 0.5, L.y1); ctx.stroke();
      ctx.fillText(grouped(Math.round(e)), xx, L.y1 + L.lanes + 6);
    }
    ctx.textAlign = 'left';
    ctx.fillText('event', L.x1 - 30, L.y1 + L.lanes + 16 > L.h ? L.y1 + 4 : L.y1 + L.lanes + 16);
    // Series: band between min and max, then the max and min edges.
    ctx.save();
    ctx.beginPath(); ctx.rect(L.x0, L.y0 - 2, L.x1 - L.x0, L.y1 - L.y0 + 4); ctx.clip();
    for (var s = vis.length - 1; s >= 0; --s) {
      var E = env[s], S = vis[s];
      ctx.globalAlpha = 0.18;
      ctx.fillStyle = S.color;
      ctx.beginPath();
      for (c = 0; c < cols; ++c) ctx.lineTo(L.x0 + c + 0.5, Y(E.hi[c]));
      for (c = cols - 1; c >= 0; --c) ctx.lineTo(L.x0 + c + 0.5, Y(E.lo[c]));
      ctx.closePath(); ctx.fill();
      ctx.globalAlpha = 1;
      ctx.strokeStyle = S.color;
      ctx.lineWidth = S.width;
      ctx.setLineDash(S.dash);
      ctx.beginPath();
      for (c = 0; c < cols; ++c) {
        var x = L.x0 + c + 0.5;
        if (c === 0) ctx.moveTo(x, Y(E.hi[c])); else ctx.lineTo(x, Y(E.hi[c]));
        if (E.lo[c] !== E.hi[c]) { ctx.lineTo(x, Y(E.lo[c])); ctx.lineTo(x, Y(E.hi[c])); }
      }
      ctx.stroke();
      ctx.setLineDash([]);
    }
    ctx.restore();
    // The peak.
    var px = L.x0 + ((peak.bucket + 0.5) - view.a) / (view.b - view.a) * (L.x1 - L.x0);
    if (px >= L.x0 && px <= L.x1 && N > 0) {
      ctx.strokeStyle = '#c0392b';
      ctx.lineWidth = 1;
      ctx.setLineDash([4, 3]);
      ctx.beginPath(); ctx.moveTo(px, L.y0); ctx.lineTo(px, L.y1); ctx.stroke();
      ctx.setLineDash([]);
      var yp = Y(peak.reserved_bytes);
      ctx.fillStyle = '#c0392b';
      ctx.beginPath(); ctx.arc(px, yp, 4, 0, 2 * Math.PI); ctx.fill();
      ctx.font = '600 12px system-ui, sans-serif';
      var label = 'peak reserved ' + human(peak.reserved_bytes) + ' (event ' + grouped(peak.event) + ')';
      var tw = ctx.measureText(label).width;
      ctx.textAlign = px + 8 + tw > L.x1 ? 'right' : 'left';
      ctx.textBaseline = 'bottom';
      ctx.fillText(label, ctx.textAlign === 'right' ? px - 8 : px + 8, Math.max(L.y0 + 14, yp - 4));
    }
    // Mark lanes.
    ctx.font = '10px system-ui, sans-serif';
    ctx.textBaseline = 'middle';
    marks.forEach(function (m, k) {
      var ly = L.y1 + 10 + k * LANE;
      ctx.fillStyle = '#5c6678';
      ctx.textAlign = 'right';
      ctx.fillText(m.name.replace(/ \(.*\)$/, ''), L.x0 - 6, ly + LANE / 2);
      ctx.fillStyle = '#f5f7fa';
      ctx.fillRect(L.x0, ly + 1, L.x1 - L.x0, LANE - 2);
      ctx.fillStyle = m.color;
      for (var c2 = 0; c2 < cols; ++c2) {
        var rr = columnBuckets(L, L.x0 + c2);
        var n = markCount(m, rr[0], rr[1]);
        if (n > 0) {
          var hgt = Math.min(LANE - 2, 3 + Math.log2(n + 1) * 2);
          ctx.fillRect(L.x0 + c2, ly + LANE - 1 - hgt, 1, hgt);
        }
      }
    });
    // Hover crosshair.
    if (hoverX !== null && hoverX >= L.x0 && hoverX < L.x1) {
      ctx.strokeStyle = 'rgba(0,0,0,.45)';
      ctx.lineWidth = 1;
      ctx.beginPath(); ctx.moveTo(Math.floor(hoverX) + 0.5, L.y0); ctx.lineTo(Math.floor(hoverX) + 0.5, L.y1 + L.lanes); ctx.stroke();
    }
    text('view-range', 'events ' + grouped(Math.floor(ev0)) + ' to ' + grouped(Math.ceil(ev1)) + ' of ' + grouped(N) +
         ((ev1 - ev0) / cols > 1 ? ' (' + ((ev1 - ev0) / cols).toFixed(1) + ' events per pixel)' : ''));
  }
  function showTooltip(clientX, clientY) {
    var rect = canvas.getBoundingClientRect();
    var L = layout();
    var x = clientX - rect.left;
    if (x < L.x0 || x >= L.x1) { tooltip.hidden = true; return; }
    var r = columnBuckets(L, Math.floor(x));
    var e0 = bucketFirstEvent(r[0]), e1 = Math.max(e0 + 1, bucketFirstEvent(r[1]));
    var html = '<b>' + (e1 - e0 === 1 ? 'event ' + grouped(e0) : 'events ' + grouped(e0) + ' to ' + grouped(e1 - 1)) + '</b>';
    if (D.bucket_time_us.length) html += ' &nbsp;' + timeOfDay(D.bucket_time_us[r[0]]);
    html += '<table>';
    series.forEach(function (s) {
      if (!s.visible) return;
      var v = range(s, r[0], r[1]);
      html += '<tr><td><span class="swatch" style="border-top-color:' + s.color + '"></span>' + s.group + ' ' + s.metric +
              '</td><td class="num">' + (v[0] === v[1] ? human(v[1]) : human(v[0]) + ' to ' + human(v[1])) + '</td></tr>';
    });
    marks.forEach(function (m) {
      var n = markCount(m, r[0], r[1]);
      if (n > 0) html += '<tr><td>' + m.name + '</td><td class="num">' + grouped(n) + '</td></tr>';
    });
    if (peak.bucket >= r[0] && peak.bucket < r[1]) html += '<tr><td colspan="2"><b style="color:#c0392b">the reserved peak: ' + exact(peak.reserved_bytes) + '</b></td></tr>';
    html += '</table>';
    tooltip.innerHTML = html;
    tooltip.hidden = false;
    var tx = x + 14, ty = clientY - rect.top + 12;
    if (tx + tooltip.offsetWidth > rect.width) tx = x - 14 - tooltip.offsetWidth;
    tooltip.style.left = Math.max(0, tx) + 'px';
    tooltip.style.top = Math.min(ty, rect.height - tooltip.offsetHeight) + 'px';
  }
  function zoom(factor, centerFrac) {
    var span = view.b - view.a, ns = Math.min(B, Math.max(Math.min(B, 8), span * factor));
    var c = view.a + span * centerFrac;
    var a = c - ns * centerFrac;
    a = Math.max(0, Math.min(B - ns, a));
    view.a = a; view.b = a + ns;
    draw();
  }
  var drag = null;
  canvas.addEventListener('wheel', function (ev) {
    ev.preventDefault();
    var L = layout(), rect = canvas.getBoundingClientRect();
    var f = Math.max(0, Math.min(1, (ev.clientX - rect.left - L.x0) / (L.x1 - L.x0)));
    zoom(ev.deltaY < 0 ? 0.8 : 1.25, f);
    showTooltip(ev.clientX, ev.clientY);
  }, { passive: false });
  canvas.addEventListener('mousedown', function (ev) { drag = { x: ev.clientX, a: view.a, b: view.b }; });
  window.addEventListener('mouseup', function () { drag = null; });
  canvas.addEventListener('mousemove', function (ev) {
    var rect = canvas.getBoundingClientRect();
    if (drag) {
      var L = layout(), d = (ev.clientX - drag.x) / (L.x1 - L.x0) * (drag.b - drag.a);
      var a = Math.max(0, Math.min(B - (drag.b - drag.a), drag.a - d));
      view.a = a; view.b = a + (drag.b - drag.a);
    }
    hoverX = ev.clientX - rect.left;
    draw();
    showTooltip(ev.clientX, ev.clientY);
  });
  canvas.addEventListener('mouseleave', function () { hoverX = null; tooltip.hidden = true; draw(); });
  canvas.addEventListener('dblclick', function () { view.a = 0; view.b = B; draw(); });
  document.getElementById('zoom-in').addEventListener('click', function () { zoom(0.5, 0.5); });
  document.getElementById('zoom-out').addEventListener('click', function () { zoom(2, 0.5); });
  document.getElementById('zoom-reset').addEventListener('click', function () { view.a = 0; view.b = B; draw(); });
  document.getElementById('zoom-peak').addEventListener('click', function () {
    var span = Math.min(B, Math.max(Math.min(B, 8), B / 50));
    view.a = Math.max(0, Math.min(B - span, peak.bucket + 0.5 - span / 2));
    view.b = view.a + span;
    draw();
  });
  window.addEventListener('resize', function () { draw(); drawMap(); });

  // --- allocations alive at the peak ------------------------------------------------------------
  var tbody = document.querySelector('#alive tbody');
  var streamName = function (i) { return D.streams[i] !== undefined ? D.streams[i] : String(i); };
  function fillAlive(limit) {
    tbody.textContent = '';
    var rows = peak.allocations.slice(0, limit);
    var frag = document.createDocumentFragment();
    rows.forEach(function (a, i) {
      var tr = document.createElement('tr');
      [String(i + 1), human(a.size), human(a.rounded), streamName(a.stream), '0x' + a.address.toString(16),
       grouped(a.event), a.line ? grouped(a.line) : '', a.thread !== undefined ? String(a.thread) : '',
       timeOfDay(a.time_us), a.frames && a.frames.length ? a.frames[0] : ''].forEach(function (t, j) {
        var td = document.createElement('td');
        td.textContent = t;
        if (j === 1) td.title = exact(a.size);
        if (j === 2) td.title = exact(a.rounded);
        if (j === 9 && a.frames) td.title = a.frames.join('\n');  // the whole stack, innermost first
        tr.appendChild(td);
      });
      frag.appendChild(tr);
    });
    tbody.appendChild(frag);
    var more = document.getElementById('alive-more');
    more.hidden = peak.allocations.length <= limit;
    more.textContent = 'show all ' + grouped(peak.allocations.length);
  }
  fillAlive(25);
  document.getElementById('alive-more').addEventListener('click', function () { fillAlive(peak.allocations.length); });
  text('alive-summary', grouped(peak.alive_count) + ' allocations, ' + human(peak.alive_requested_bytes) + ' requested, ' +
       human(peak.alive_rounded_bytes) + ' rounded; largest first' +
       (peak.alive_count > peak.allocations.length ? ' (the ' + grouped(peak.allocations.length) + ' largest listed)' : '') +
       '. Trace line, thread and time are where the trace recorded each allocation' +
       (D.snapshot ? ' (a PyTorch snapshot: the line is the entry of its device trace, 0 for an ' +
        'allocation made before its history began; the call site is the innermost frame, hover ' +
        'for the stack)' : '') + '.');

  // --- segment map at the peak ------------------------------------------------------------------
  var mapCanvas = document.getElementById('map');
  var mctx = mapCanvas.getContext('2d');
  var mapTip = document.getElementById('map-tooltip');
  var segs = (peak.snapshot.segments || []).slice().sort(function (x, y) {
    return x.stream - y.stream || (x.pool < y.pool ? 1 : x.pool > y.pool ? -1 : 0) || x.address - y.address;
  });
  var MAX_ROWS = 300, ROW = 16, LABEL = 300;
  var shown = segs.slice(0, MAX_ROWS);
  var holes = 0, holeBytes = 0, unmapped = 0;
  // Free holes: free blocks of ordinary segments; in an expandable range, the free bytes that lie
  // on mapped pages (free virtual space elsewhere is unmapped, not a hole).
  segs.forEach(function (s) {
    s.blocks.forEach(function (b) {
      if (b.state !== 'free') return;
      if (!s.expandable) { ++holes; holeBytes += b.size; return; }
      var onMapped = 0;
      (s.mappings || []).forEach(function (m) {
        onMapped += Math.max(0, Math.min(b.address + b.size, m.address + m.size) - Math.max(b.address, m.address));
      });
      if (onMapped > 0) { ++holes; holeBytes += onMapped; }
    });
    if (s.expandable) unmapped += s.unmapped_bytes;
  });
  // A row spans its segment; an expandable range spans what is mapped or used of it (the rest of
  // its virtual reservation is unmapped and said in the label).
  function extent(s) {
    if (!s.expandable) return s.size;
    var end = 0;
    s.blocks.forEach(function (b) { if (b.state !== 'free') end = Math.max(end, b.address + b.size - s.address); });
    (s.mappings || []).forEach(function (m) { end = Math.max(end, m.address + m.size - s.address); });
    return Math.max(end, Math.min(s.size, s.page_bytes || s.size));
  }
  text('map-summary', grouped(segs.length) + ' segment' + (segs.length === 1 ? '' : 's') + ' (' +
       human(peak.snapshot.reserved_bytes || 0) + ' reserved, ' + human(peak.snapshot.allocated_bytes || 0) +
       ' allocated); ' + grouped(holes) + ' free holes, ' + human(holeBytes) +
       (D.expandable ? '; ' + human(unmapped) + ' of virtual ranges unmapped' : '') +
       (segs.length > MAX_ROWS ? '; the first ' + MAX_ROWS + ' drawn' : ''));
  var legend = document.getElementById('map-legend');
  [['#3b7dd8', 'allocated'], ['#f0a030', 'freed, waiting on another stream'], ['#ffffff', 'free hole']].concat(
    D.expandable ? [['#d9dee7', 'mapped page, free'], ['#8a93a3', 'unmapped']] : []).forEach(function (k) {
    var sp = document.createElement('span');
    sp.className = 'key';
    sp.style.background = k[0];
    legend.appendChild(sp);
    legend.appendChild(document.createTextNode(k[1]));
  });
  function drawMap() {
    var dpr = window.devicePixelRatio || 1;
    var w = mapCanvas.clientWidth, h = Math.max(ROW + 8, shown.length * ROW + 8);
    mapCanvas.style.height = h + 'px';
    mapCanvas.width = Math.round(w * dpr);
    mapCanvas.height = Math.round(h * dpr);
    mctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    mctx.clearRect(0, 0, w, h);
    mctx.font = '11px system-ui, sans-serif';
    mctx.textBaseline = 'middle';
    var x0 = LABEL, x1 = w - 8;
    shown.forEach(function (s, i) {
      var y = 4 + i * ROW, ext = extent(s), sc = (x1 - x0) / ext;
      mctx.fillStyle = '#5c6678';
      mctx.textAlign = 'right';
      mctx.fillText(s.pool + ' · stream 0x' + s.stream.toString(16) + ' · ' +
                    (s.expandable ? human(s.mapped_bytes) + ' / ' + human(s.size) + ' VA' : human(s.size)),
                    x0 - 6, y + ROW / 2);
      mctx.fillStyle = s.expandable ? '#8a93a3' : '#ffffff';
      mctx.fillRect(x0, y + 1, x1 - x0, ROW - 3);
      if (s.expandable) {
        (s.mappings || []).forEach(function (m) {
          mctx.fillStyle = '#d9dee7';
          mctx.fillRect(x0 + (m.address - s.address) * sc, y + 1, Math.max(1, m.size * sc), ROW - 3);
        });
      }
      s.blocks.forEach(function (b) {
        if (b.state === 'free') return;
        mctx.fillStyle = b.state === 'allocated' ? '#3b7dd8' : '#f0a030';
        var bx = x0 + (b.address - s.address) * sc;
        if (bx > x1) return;
        mctx.fillRect(bx, y + 1, Math.max(1, Math.min(x1 - bx, b.size * sc) - 0.5), ROW - 3);
      });
      if (!s.expandable) {
        // Free holes outlined so that they stand out against the white.
        mctx.strokeStyle = '#c0392b';
        mctx.lineWidth = 1;
        s.blocks.forEach(function (b) {
          if (b.state !== 'free') return;
          var bx = x0 + (b.address - s.address) * sc;
          mctx.strokeRect(Math.round(bx) + 0.5, y + 1.5, Math.max(1, b.size * sc - 1), ROW - 4);
        });
      }
      mctx.strokeStyle = '#9aa3b2';
      mctx.strokeRect(x0 + 0.5, y + 1.5, x1 - x0 - 1, ROW - 4);
    });
  }
  mapCanvas.addEventListener('mousemove', function (ev) {
    var rect = mapCanvas.getBoundingClientRect();
    var x = ev.clientX - rect.left, y = ev.clientY - rect.top;
    var i = Math.floor((y - 4) / ROW), s = shown[i];
    var x0 = LABEL, x1 = rect.width - 8;
    if (!s || x < x0 || x > x1) { mapTip.hidden = true; return; }
    var addr = s.address + (x - x0) / (x1 - x0) * extent(s), hit = null;
    s.blocks.forEach(function (b) { if (addr >= b.address && addr < b.address + b.size) hit = b; });
    var html = '<b>segment ' + s.id + '</b>: ' + s.pool + ' pool, stream 0x' + s.stream.toString(16) + ', ' + exact(s.size) +
               (s.expandable ? ' of virtual range, ' + human(s.mapped_bytes) + ' mapped' : '');
    if (hit) {
      html += '<br>block 0x' + hit.address.toString(16) + ': ' + hit.state + ', ' + exact(hit.size) +
              (hit.state === 'allocated' ? ' (requested ' + exact(hit.requested_size) + ')' : '');
    }
    mapTip.innerHTML = html;
    mapTip.hidden = false;
    var tx = x + 14;
    if (tx + mapTip.offsetWidth > rect.width) tx = x - 14 - mapTip.offsetWidth;
    mapTip.style.left = Math.max(0, tx) + 'px';
    mapTip.style.top = (y + 12) + 'px';
  });
  mapCanvas.addEventListener('mouseleave', function () { mapTip.hidden = true; });

  var t0 = performance.now();
  draw();
  drawMap();
  document.body.setAttribute('data-render-ms', String(Math.round(performance.now() - t0)));
  if (window.cucacheErrors.length === 0) document.body.setAttribute('data-status', 'ok');
})();
