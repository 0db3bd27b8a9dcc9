"""``report.html``: one self-contained page from ``summary.json`` that opens offline.

The summary is embedded as JSON and a small inline script draws every chart as SVG (no CDN, no
library): messages per node over time, redundancy coverage over time, latency and shadow hold
time histograms, a failover timeline, then the anomaly table. Each chart's container gets
``data-rendered="true"`` once drawn, and the body ``data-charts`` the number drawn, so a
headless browser can check the page really rendered. It must never fetch anything.
"""

from __future__ import annotations

import html
import json
from typing import Any

_STYLE = """
body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}
.kpi{display:inline-block;margin:0 18px 8px 0;padding:8px 12px;background:#f3f5f8;border-radius:6px}
.kpi b{display:block;font-size:18px}.chart{margin:8px 0}svg text{font-size:10px;fill:#333}
.bad{color:#b00020}
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


def render(summary: dict[str, Any]) -> str:
    """The whole page as one string."""
    esc = html.escape
    data = json.dumps(summary, default=str).replace("</", "<\\/")
    s = summary
    kpis = [
        ("messages", s["messages"]), ("redundancy coverage", _pct(s["redundancy_coverage"])),
        ("lost", s["lost"]), ("promoted", s["promoted"]),
        ("accepted unprotected", s["unprotected_messages"]),
        ("time unprotected", f"{s['unprotected_seconds']:.1f} s"),
        ("duplicates outside boundary", s["duplicates"]["outside_boundary"]),
        ("duplicates dropped inside", s["duplicates"]["inside_boundary"]),
        ("latency p50 / p95 / p99", " / ".join(_secs(s["latency_seconds"][k]) for k in ("p50", "p95", "p99"))),
        ("shadow hold p50 / p95 / p99",
         " / ".join(_secs(s["shadow_hold_seconds"][k]) for k in ("p50", "p95", "p99"))),
        ("malformed rows", s["malformed"]["rows"]),
    ]
    kpi_html = "".join(f'<div class="kpi">{esc(k)}<b>{esc(str(v))}</b></div>' for k, v in kpis)
    states = "".join(f"<tr><td>{esc(k)}</td><td>{v}</td></tr>" for k, v in s["states"].items())
    nodes = "".join(
        f"<tr><td>{esc(c['node'])}</td><td>{c['received']}</td><td>{_pct(c['coverage'])}</td>"
        f"<td>{c['unprotected_seconds']:.1f}</td><td>{sum(s['events_by_node'].get(c['node'], {}).values())}</td></tr>"
        for c in s["coverage_by_node"])
    episodes = "".join(
        f"<tr><td>{esc(e['start'] or '')}</td><td>{esc(e['primary'] or '')}</td><td>{esc(e['shadow_node'])}</td>"
        f"<td>{esc(e['reason'] or '')}</td><td>{e['messages']}</td></tr>" for e in s["failover_episodes"])
    anomalies = "".join(
        f"<tr><td>{esc(a['kind'])}</td><td>{esc(a['key'] or '')}</td><td>{esc(a['node'] or '')}</td>"
        f"<td>{esc(a['time'] or '')}</td><td>{esc(a['detail'] or '')}</td></tr>" for a in s["anomalies"]["sample"])
    counts = ", ".join(f"{k}: {v}" for k, v in s["anomalies"]["counts"].items())
    malformed = "".join(f"<tr><td>{esc(m['file'])}</td><td>{esc(m['reason'])}</td><td>{m['rows']}</td></tr>"
                        for m in s["malformed"]["by_file"][:50])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>transportd tracking-log analysis</title>
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'">
<style>{_STYLE}</style></head>
<body data-charts="0">
<h1>transportd tracking-log analysis</h1>
<p>{esc(str(s['log_start']))} to {esc(str(s['log_end']))}: {s['events']} events from {len(s['events_by_node'])} node(s),
time buckets of {s['bucket_seconds']} s.</p>
{kpi_html}
<h2>Messages received per node over time</h2><div class="chart" id="chart-messages"></div>
<h2>Redundancy coverage over time</h2><div class="chart" id="chart-coverage"></div>
<h2>End-to-end latency (first RECEIVE to last delivery)</h2><div class="chart" id="chart-latency"></div>
<h2>Shadow hold time (HARECEIVE to HADISCARD)</h2><div class="chart" id="chart-hold"></div>
<h2>Failover timeline (RESUBMIT REDUNDANCY)</h2><div class="chart" id="chart-failover"></div>
<table><tr><th>start</th><th>primary</th><th>shadow node</th><th>reason</th><th>promoted</th></tr>{episodes}</table>
<h2>Final states</h2><table><tr><th>state</th><th>messages</th></tr>{states}</table>
<h2>Nodes</h2><table><tr><th>node</th><th>received</th><th>coverage</th><th>unprotected s</th><th>events</th></tr>{nodes}</table>
<h2>Anomalies</h2><p class="{'bad' if any(s['anomalies']['counts'].values()) else ''}">{esc(counts)}
(first {len(s['anomalies']['sample'])} shown; all in <code>anomalies/</code>)</p>
<table id="anomalies"><tr><th>kind</th><th>message</th><th>node</th><th>time</th><th>detail</th></tr>{anomalies}</table>
<h2>Malformed rows</h2><table><tr><th>file</th><th>reason</th><th>rows</th></tr>{malformed}</table>
<script type="application/json" id="summary-data">{data}</script>
<script>{_SCRIPT}</script>
</body></html>
"""
