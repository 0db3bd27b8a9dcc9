"""``report.html``: one self-contained page from ``summary.json`` that opens offline.

It opens on the operator's first question: was anything lost or left unprotected, when, on which
node, which messages (a verdict line, the counts, per node, the lost and unprotected messages
over time, the anomaly table); then the failover timeline; then the distributions (messages per
node and coverage over time, latency and shadow hold time histograms) and the reference tables.
The summary is embedded as JSON and a small inline script draws every chart as SVG (no CDN, no
library); charts scale to the page width, so the page reads on a phone too. Each chart's container gets
``data-rendered="true"`` once drawn, and the body ``data-charts`` the number drawn, so a
headless browser can check the page really rendered. It must never fetch anything.
"""

from __future__ import annotations

import html
import json
from typing import Any

_STYLE = """
body{font-family:system-ui,sans-serif;margin:16px;color:#222;max-width:1100px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}
.scroll{overflow-x:auto;max-width:100%}
.kpi{display:inline-block;margin:0 12px 8px 0;padding:8px 12px;background:#f3f5f8;border-radius:6px}
.kpi b{display:block;font-size:18px}.kpi.bad{background:#fdecee}.chart{margin:8px 0}
.chart svg{width:100%;height:auto}svg text{font-size:11px;fill:#333}
.bad{color:#b00020}.ok{color:#1b7a2f}
.verdict{font-size:18px;padding:12px 14px;border-radius:6px;background:#eef7f0;margin:8px 0 12px}
.verdict.bad{background:#fdecee}
@media (max-width:600px){body{margin:8px}.kpi{display:block;margin:0 0 6px}h1{font-size:18px}}
"""

_SCRIPT = r"""
(function(){
const S = JSON.parse(document.getElementById('summary-data').textContent);
const NS = 'http://www.w3.org/2000/svg';
const COLORS = ['#1f77b4','#ff7f0e','#2ca02c','#d62728','#9467bd','#8c564b','#e377c2','#7f7f7f','#bcbd22','#17becf'];
let drawn = 0;
function el(name, attrs, parent){const e=document.createElementNS(NS,name);for(const k in attrs)e.setAttribute(k,attrs[k]);if(parent)parent.appendChild(e);return e;}
function text(parent,x,y,s,anchor){const t=el('text',{x:x,y:y,'text-anchor':anchor||'start'},parent);t.textContent=s;return t;}
function frame(id,w,h){const box=document.getElementById(id);const svg=el('svg',{width:w,height:h,viewBox:'0 0 '+w+' '+h,role:'img'},box);return [box,svg];}
function done(box,n){box.setAttribute('data-rendered','true');box.setAttribute('data-marks',String(n));drawn++;}
function empty(box,svg,msg){text(svg,10,20,msg);done(box,0);}
function lineChart(id,series,ymax,fmt){
  const W=1000,H=240,L=50,B=30,T=10,R=150;const [box,svg]=frame(id,W,H);
  const n=S.timeline.length; if(!n){empty(box,svg,'no data');return;}
  const x=i=>L+(n>1?i*(W-L-R)/(n-1):0), y=v=>H-B-(ymax>0?v/ymax:0)*(H-B-T);
  el('line',{x1:L,y1:H-B,x2:W-R,y2:H-B,stroke:'#888'},svg);el('line',{x1:L,y1:T,x2:L,y2:H-B,stroke:'#888'},svg);
  text(svg,L-4,T+8,fmt(ymax),'end');text(svg,L-4,H-B,fmt(0),'end');
  text(svg,L,H-8,S.timeline[0].time);text(svg,W-R,H-8,S.timeline[n-1].time,'end');
  let marks=0;
  series.forEach((s,k)=>{const pts=[];s.values.forEach((v,i)=>{if(v!==null&&v!==undefined)pts.push(x(i)+','+y(v));});
    if(pts.length===1){el('circle',{cx:pts[0].split(',')[0],cy:pts[0].split(',')[1],r:3,fill:COLORS[k%10]},svg);}
    el('polyline',{points:pts.join(' '),fill:'none',stroke:COLORS[k%10],'stroke-width':1.5,'class':'series'},svg);marks++;
    el('rect',{x:W-R+10,y:T+k*14,width:10,height:10,fill:COLORS[k%10]},svg);text(svg,W-R+24,T+9+k*14,s.name);});
  done(box,marks);
}
function bars(id,hist){
  const W=1000,H=220,L=50,B=40,T=10;const [box,svg]=frame(id,W,H);
  const max=Math.max(0,...hist.map(h=>h.count)); if(!max){empty(box,svg,'no data');return;}
  const bw=(W-L-10)/hist.length; let marks=0;
  hist.forEach((h,i)=>{const bh=h.count/max*(H-B-T);
    el('rect',{x:L+i*bw+1,y:H-B-bh,width:bw-2,height:bh,fill:'#1f77b4','class':'bar'},svg);marks++;
    text(svg,L+i*bw+bw/2,H-B+12,h.to===null?('>'+h.from):('<'+h.to),'middle');
    if(h.count)text(svg,L+i*bw+bw/2,H-B-bh-2,String(h.count),'middle');});
  text(svg,L,H-6,'seconds');text(svg,L-4,T+8,String(max),'end');
  done(box,marks);
}
function timeline(id){
  const eps=S.failover_episodes; const W=1000,H=Math.max(60,30+eps.length*18),L=10,R=10;const [box,svg]=frame(id,W,H);
  if(!eps.length){empty(box,svg,'no failover in these logs');return;}
  const t0=Date.parse(S.log_start),t1=Math.max(Date.parse(S.log_end),t0+1);
  const x=t=>L+(Date.parse(t)-t0)/(t1-t0)*(W-L-R-300);
  el('line',{x1:L,y1:H-12,x2:W-R-300,y2:H-12,stroke:'#888'},svg);
  text(svg,L,H-1,S.log_start);text(svg,W-R-300,H-1,S.log_end,'end');let marks=0;
  eps.forEach((e,i)=>{const y=14+i*18;const a=x(e.start),b=Math.max(x(e.end),a+4);
    el('rect',{x:a,y:y-8,width:b-a,height:10,fill:'#d62728','class':'episode'},svg);marks++;
    text(svg,W-R-290,y,e.primary+' -> '+e.shadow_node+' ('+e.reason+'): '+e.messages+' promoted');});
  done(box,marks);
}
const risk=[{name:'lost',values:S.timeline.map(b=>b.lost||0)},{name:'accepted unprotected',values:S.timeline.map(b=>b.unprotected||0)}];
lineChart('chart-risk',risk,Math.max(1,...risk.flatMap(r=>r.values)),v=>String(Math.round(v)));
const nodes=[...new Set(S.timeline.flatMap(b=>Object.keys(b.by_node)))].sort();
const maxCount=Math.max(0,...S.timeline.flatMap(b=>Object.values(b.by_node)));
lineChart('chart-messages',nodes.map(n=>({name:n,values:S.timeline.map(b=>b.by_node[n]||0)})),maxCount,v=>String(Math.round(v)));
lineChart('chart-coverage',[{name:'coverage',values:S.timeline.map(b=>b.coverage)}],1,v=>Math.round(v*100)+' %');
bars('chart-latency',S.histograms.latency_seconds);
bars('chart-hold',S.histograms.shadow_hold_seconds);
timeline('chart-failover');
document.body.setAttribute('data-charts',String(drawn));
})();
"""


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


BAD = ' class="bad"'


def _verdict(s: dict[str, Any]) -> tuple[bool, str]:
    lost = s["lost"]
    unprot = s["states"].get("in flight unprotected", 0)
    accepted = s["unprotected_messages"]
    left = s["states"].get("left the logs", 0)
    bad = bool(lost or unprot or accepted)
    parts = []
    parts.append(f"{lost} message(s) lost" if lost else "no message lost")
    parts.append(f"{unprot} still in flight with a single copy" if unprot else "none in flight unprotected")
    parts.append(f"{accepted} accepted without a shadow ({s['unprotected_seconds']:.1f} s unprotected in all)"
                 if accepted else "every received message was shadowed")
    if left:
        parts.append(f"{left} handed to servers whose logs were not given")
    return bad, "; ".join(parts) + "."


def render(summary: dict[str, Any]) -> str:
    """The whole page as one string."""
    esc = html.escape
    data = json.dumps(summary, default=str).replace("</", "<\\/")
    s = summary
    bad, verdict = _verdict(s)
    first = [
        ("lost", s["lost"], s["lost"] > 0),
        ("in flight unprotected", s["states"].get("in flight unprotected", 0),
         s["states"].get("in flight unprotected", 0) > 0),
        ("accepted unprotected", s["unprotected_messages"], s["unprotected_messages"] > 0),
        ("time unprotected", f"{s['unprotected_seconds']:.1f} s", s["unprotected_seconds"] > 0),
        ("redundancy coverage", _pct(s["redundancy_coverage"]), False),
        ("left the logs", s["states"].get("left the logs", 0), False),
        ("duplicates outside boundary", s["duplicates"]["outside_boundary"], s["duplicates"]["outside_boundary"] > 0),
    ]
    first_html = "".join(f'<div class="kpi{" bad" if b else ""}">{esc(k)}<b>{esc(str(v))}</b></div>'
                         for k, v, b in first)
    kpis = [
        ("messages", s["messages"]), ("promoted", s["promoted"]),
        ("duplicates dropped inside", s["duplicates"]["inside_boundary"]),
        ("latency p50 / p95 / p99", " / ".join(_secs(s["latency_seconds"][k]) for k in ("p50", "p95", "p99"))),
        ("shadow hold p50 / p95 / p99",
         " / ".join(_secs(s["shadow_hold_seconds"][k]) for k in ("p50", "p95", "p99"))),
        ("malformed rows", s["malformed"]["rows"]),
        ("rows about no message", s.get("non_message_rows", {}).get("rows", 0)),
    ]
    kpi_html = "".join(f'<div class="kpi">{esc(k)}<b>{esc(str(v))}</b></div>' for k, v in kpis)
    states = "".join(f"<tr><td>{esc(k)}</td><td>{v}</td></tr>" for k, v in s["states"].items())
    events = s["events_by_node"]
    node_names = sorted(set(events) | {c["node"] for c in s["coverage_by_node"]})
    cov = {c["node"]: c for c in s["coverage_by_node"]}
    nodes = "".join(
        f"<tr><td>{esc(n)}</td><td{BAD if cov.get(n, {}).get('lost') else ''}>{cov.get(n, {}).get('lost', 0)}</td>"
        f"<td>{cov.get(n, {}).get('unprotected_messages', 0)}</td><td>{cov.get(n, {}).get('unprotected_seconds', 0.0):.1f}</td>"
        f"<td>{cov.get(n, {}).get('received', 0)}</td><td>{_pct(cov.get(n, {}).get('coverage'))}</td>"
        f"<td>{sum(events.get(n, {}).values())}</td></tr>" for n in node_names)
    episodes = "".join(
        f"<tr><td>{esc(e['start'] or '')}</td><td>{esc(e['primary'] or '')}</td><td>{esc(e['shadow_node'])}</td>"
        f"<td>{esc(e['reason'] or '')}</td><td>{e['messages']}</td></tr>" for e in s["failover_episodes"])
    anomalies = "".join(
        f"<tr><td>{esc(a['kind'])}</td><td>{esc(a['time'] or '')}</td><td>{esc(a['node'] or '')}</td>"
        f"<td>{esc(a['key'] or '')}</td><td>{esc(a['detail'] or '')}</td></tr>" for a in s["anomalies"]["sample"])
    counts = ", ".join(f"{k}: {v}" for k, v in s["anomalies"]["counts"].items())
    malformed = "".join(f"<tr><td>{esc(m['file'])}</td><td>{esc(m['reason'])}</td><td>{m['rows']}</td></tr>"
                        for m in s["malformed"]["by_file"][:50])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>transportd tracking-log analysis</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'">
<style>{_STYLE}</style></head>
<body data-charts="0">
<h1>transportd tracking-log analysis</h1>
<p>{esc(str(s['log_start']))} to {esc(str(s['log_end']))}: {s['events']} events from {len(s['events_by_node'])} node(s),
time buckets of {s['bucket_seconds']} s.</p>
<section id="first-question">
<h2>Was anything lost or left unprotected?</h2>
<p class="verdict{' bad' if bad else ''}" id="verdict">{esc(verdict)}</p>
{first_html}
<h2>When: lost and unprotected messages by time of receipt</h2><div class="chart" id="chart-risk"></div>
<h2>Where: per node</h2>
<div class="scroll"><table id="nodes"><tr><th>node</th><th>lost</th><th>accepted unprotected</th><th>unprotected s</th>
<th>received</th><th>coverage</th><th>events</th></tr>{nodes}</table></div>
<h2>Which messages</h2><p class="{'bad' if any(s['anomalies']['counts'].values()) else ''}">{esc(counts)}
(first {len(s['anomalies']['sample'])} shown; all in <code>anomalies/</code>, every message in <code>messages/</code>)</p>
<div class="scroll"><table id="anomalies"><tr><th>kind</th><th>time</th><th>node</th><th>message</th><th>detail</th></tr>{anomalies}</table></div>
</section>
<section id="failover">
<h2>Failover timeline (RESUBMIT REDUNDANCY)</h2><div class="chart" id="chart-failover"></div>
<div class="scroll"><table><tr><th>start</th><th>primary</th><th>shadow node</th><th>reason</th><th>promoted</th></tr>{episodes}</table></div>
</section>
<section id="distributions">
<h2>Messages received per node over time</h2><div class="chart" id="chart-messages"></div>
<h2>Redundancy coverage over time</h2><div class="chart" id="chart-coverage"></div>
<h2>End-to-end latency (first RECEIVE to last delivery)</h2><div class="chart" id="chart-latency"></div>
<h2>Shadow hold time (HARECEIVE to HADISCARD)</h2><div class="chart" id="chart-hold"></div>
{kpi_html}
<h2>Final states</h2><table><tr><th>state</th><th>messages</th></tr>{states}</table>
<h2>Malformed rows</h2><div class="scroll"><table><tr><th>file</th><th>reason</th><th>rows</th></tr>{malformed}</table></div>
</section>
<script type="application/json" id="summary-data">{data}</script>
<script>{_SCRIPT}</script>
</body></html>
"""
