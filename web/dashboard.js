// The dashboard: charts of the step metrics and heatmaps of expert load. Data comes
// from window.MOE_DATA (a `moe report` file) or by polling api/metrics?since=N (live).
// Record fields are the JSONL fields of docs/METRICS.md.
(function () {
  "use strict";
  const state = { run: null, steps: [], val: [], alerts: [], done: false, next: 0 };

  function ingest(data) {
    if (data.run) state.run = data.run;
    for (const r of data.records || []) {
      if (r.type === "step") {
        // A resumed run repeats steps: the newest record of a step wins.
        while (state.steps.length && state.steps[state.steps.length - 1].step >= r.step) state.steps.pop();
        state.steps.push(r);
      } else if (r.type === "val") {
        while (state.val.length && state.val[state.val.length - 1].step >= r.step) state.val.pop();
        state.val.push(r);
      } else if (r.type === "alert") {
        state.alerts.push(r);
      }
    }
    if (typeof data.next === "number") state.next = data.next;
    state.done = !!data.done;
  }

  const charts = {};
  const colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];

  // One line chart per canvas; `series` is [[label, points]], points [{x, y}].
  function plot(id, series, fromZero) {
    const canvas = document.getElementById(id);
    if (!charts[id]) {
      charts[id] = new Chart(canvas, {
        type: "line",
        data: { datasets: series.map(([label], i) => ({
          label, data: [], borderColor: colors[i % colors.length], backgroundColor: colors[i % colors.length],
          borderWidth: 1.5, pointRadius: 0, tension: 0 })) },
        options: {
          animation: false, responsive: true, maintainAspectRatio: false,
          plugins: { legend: { display: series.length > 1, labels: { boxWidth: 10 } } },
          scales: { x: { type: "linear", title: { display: true, text: "step" } },
                    y: { beginAtZero: !!fromZero } },
        },
      });
    }
    const chart = charts[id];
    series.forEach(([, points], i) => { chart.data.datasets[i].data = points; });
    chart.update("none");
    // For tests and for people reading the DOM: how many points are drawn.
    canvas.dataset.points = String(series.reduce((n, [, points]) => n + points.length, 0));
  }

  const pts = (rows, f) => rows.map((r) => ({ x: r.step, y: f(r) })).filter((p) => p.y !== null && isFinite(p.y));

  function heat(value, max) {
    const t = max > 0 ? value / max : 0;
    // white -> deep orange
    const r = 255, g = Math.round(255 - 155 * t), b = Math.round(255 - 225 * t);
    return `rgb(${r},${g},${b})`;
  }

  function table(id, columns, rows) {
    // rows: [{label, attrs, cells: [{value|null, attrs}]}]
    const el = document.getElementById(id);
    let max = 0;
    for (const row of rows) for (const c of row.cells) if (c.value !== null) max = Math.max(max, c.value);
    const head = "<tr><th></th>" + columns.map((c) => `<th>${c}</th>`).join("") + "</tr>";
    const body = rows.map((row) => `<tr><th>${row.label}</th>` + row.cells.map((c) => {
      if (c.value === null) return `<td class="empty"></td>`;
      const attrs = Object.entries(c.attrs).map(([k, v]) => ` data-${k}="${v}"`).join("");
      return `<td class="cell"${attrs} data-value="${c.value}" style="background:${heat(c.value, max)}">${c.value}</td>`;
    }).join("") + "</tr>").join("");
    el.innerHTML = head + body;
  }

  function heatmaps(last) {
    const nExperts = state.run ? state.run.n_experts : (last.layers[0] || { tokens_per_expert: [] }).tokens_per_expert.length;
    const experts = Array.from({ length: nExperts }, (_, e) => `e${e}`);
    table("heatmap-load", experts, last.layers.map((l) => ({
      label: `layer ${l.layer}`,
      cells: l.tokens_per_expert.map((v, e) => ({ value: v, attrs: { layer: l.layer, expert: e } })),
    })));
    document.getElementById("heatmap-step").textContent = `(step ${last.step})`;
    table("heatmap-ranks", experts, (last.ranks || []).map((r) => {
      const cells = experts.map(() => ({ value: null, attrs: {} }));
      r.experts.forEach((e, i) => { cells[e] = { value: r.load[i], attrs: { rank: r.rank, expert: e } }; });
      return { label: `rank ${r.rank}`, cells };
    }));
  }

  function render() {
    const run = state.run;
    if (run) {
      document.getElementById("run-info").textContent =
        `${run.n_layers} layers, MoE layers [${run.moe_layers.join(", ")}], ${run.n_experts} experts top-${run.top_k}, ` +
        `${(run.params_total / 1e6).toFixed(2)}M params (${(run.params_active / 1e6).toFixed(2)}M active), ` +
        `${run.tokens_per_step} tokens/step, world size ${run.world_size}`;
      const m = run.mfu_inputs;
      document.getElementById("mfu-inputs").textContent = m.peak_flops > 0
        ? `MFU = tok/s x (6 x ${m.active_non_embedding_params} + 12 x ${m.n_layers} x ${m.dim} x ${m.seq_len}) / ` +
          `${(m.peak_flops / 1e12).toFixed(0)} TFLOP/s = tok/s x ${m.flops_per_token.toExponential(3)} / peak`
        : `MFU not reported: no peak figure for this device (a CPU run)`;
    }
    const steps = state.steps;
    const last = steps[steps.length - 1];
    const total = run ? run.steps : (last ? last.steps : 0);
    document.getElementById("status").textContent = last
      ? `${state.done ? "finished" : "training"}: step ${last.step}/${total}, loss ${last.loss.toFixed(4)}`
      : "waiting for data";
    plot("chart-loss", [["train", pts(steps, (r) => r.loss)], ["validation", pts(state.val, (r) => r.val_loss)]]);
    plot("chart-lr", [["lr", pts(steps, (r) => r.lr)]]);
    plot("chart-tokens", [["tokens/s", pts(steps, (r) => r.tokens_per_s)]]);
    plot("chart-mfu", [["MFU %", pts(steps, (r) => r.mfu * 100)]]);
    plot("chart-comm", [["comm wait %", pts(steps, (r) => r.comm_wait_fraction * 100)]], true);
    plot("chart-time", [["compute", pts(steps, (r) => r.time_s.compute)], ["comm wait", pts(steps, (r) => r.time_s.comm_wait)],
                        ["data wait", pts(steps, (r) => r.time_s.data_wait)], ["optimizer", pts(steps, (r) => r.time_s.optimizer)]], true);
    // Every MoE layer routes the same number of assignments, so the mean of the layers'
    // fractions is the step's fraction.
    const over = (r, f, agg) => (r.layers && r.layers.length ? agg(r.layers.map(f)) : null);
    const mean = (v) => v.reduce((a, b) => a + b, 0) / v.length;
    plot("chart-dropped", [["all MoE layers", pts(steps, (r) => over(r, (l) => l.dropped_fraction * 100, mean))],
                           ["worst layer", pts(steps, (r) => over(r, (l) => l.dropped_fraction * 100, (v) => Math.max(...v)))]], true);
    plot("chart-entropy", [["mean over MoE layers", pts(steps, (r) => over(r, (l) => l.router_entropy, mean))],
                           ["lowest layer", pts(steps, (r) => over(r, (l) => l.router_entropy, (v) => Math.min(...v)))]], true);
    // The router temperature each layer routed with (moe.temperature_control moves it).
    const temp = (f) => pts(steps, (r) => over(r, (l) => (l.temperature > 0 ? l.temperature : NaN), f));
    plot("chart-temperature", [["lowest layer", temp((v) => Math.min(...v))], ["mean over MoE layers", temp(mean)],
                               ["highest layer", temp((v) => Math.max(...v))]]);
    // The board (GPU runs; NVML's readings where it answers; absent on the CPU): a
    // power-capped clock is why a step is slower than its kernels' times add up to, and the
    // SMs' own count runs below NVML's clock in GEMM-heavy steps (docs/PROFILING.md).
    const board = (f) => pts(steps, (r) => (r.board ? f(r.board) : null));
    plot("chart-clock", [["SM clock (NVML)", board((b) => b.sm_clock_mhz ?? null)],
                         ["SMs counted", board((b) => b.sm_clock_counted_mhz ?? null)]]);
    plot("chart-power", [["power", board((b) => b.power_w)]], true);
    plot("chart-capped", [["power-capped", board((b) => b.power_capped * 100)]], true);
    if (last) heatmaps(last);
    const list = document.getElementById("alerts");
    if (state.alerts.length) {
      list.innerHTML = "";
      for (const a of state.alerts) {
        const li = document.createElement("li");
        li.className = a.raised ? "raised" : "cleared";
        li.textContent = a.message;
        list.appendChild(li);
      }
    }
    if (last) document.body.dataset.renderedStep = String(last.step);
  }

  function poll() {
    fetch(`api/metrics?since=${state.next}`)
      .then((response) => response.json())
      .then((data) => {
        ingest(data);
        render();
        if (!state.done) setTimeout(poll, 1000);
      })
      .catch(() => {
        document.getElementById("status").textContent += " (disconnected; retrying)";
        setTimeout(poll, 3000);
      });
  }

  // A report file carries all its data; the live page carries the records so far and
  // polls for the rest until the run is done.
  if (window.MOE_DATA) {
    ingest(window.MOE_DATA);
    render();
  }
  if (window.MOE_LIVE && !state.done) setTimeout(poll, 1000);
})();
