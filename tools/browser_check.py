"""Looks at the built docs site in headless Chromium: images load, tables fit.

Not part of the pytest run (CI machines have no browser): run by hand after a
change to the docs' layout, with Debian's chromium and `pip install playwright`:

    mkdocs build --site-dir /tmp/site
    python tools/browser_check.py /tmp/site [--screenshots DIR]

For the home, API and benchmarks pages (and the notebooks) at 1280 x 900 it checks
that every <img> has loaded (naturalWidth > 0) and that no table is wider than the
content column unless it sits in a scrolling wrapper, on the benchmarks and
optimizer pages that every table fits without scrolling, and on the notebook pages
that no output or code block wraps its lines or cuts them (a wide one scrolls);
it exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import pathlib
import sys
import threading

PAGES = [
    "index.html",
    "api/amp/index.html",
    "api/optim/index.html",
    "benchmarks/index.html",
    "optim/index.html",
    "notebooks/quickstart/index.html",
    "notebooks/pure_bf16_optimizers/index.html",
    "notebooks/flax_nnx/index.html",
]

CHECK = """() => {
  const imgs = [...document.querySelectorAll('article img')].map(i => ({src: i.src.slice(0, 80), ok: i.complete && i.naturalWidth > 0}));
  const col = document.querySelector('article.md-content__inner').getBoundingClientRect();
  const tables = [...document.querySelectorAll('article table')].map(t => {
    let scroller = null;
    for (let p = t.parentElement; p && p.tagName !== 'ARTICLE'; p = p.parentElement) {
      const o = getComputedStyle(p).overflowX;
      if (o === 'auto' || o === 'scroll') { scroller = p; break; }
    }
    const r = t.getBoundingClientRect();
    // a table fits when nothing of it is hidden: inside the column, and no scrolling needed
    const fits = r.right <= col.right + 1 && (scroller === null || scroller.scrollWidth <= scroller.clientWidth + 1);
    // the theme's scrolling wrapper reaches 0.8rem into the column's padding
    const scrolls = scroller !== null && scroller.getBoundingClientRect().right <= col.right + 24;
    return {fits, scrolls, width: Math.round(r.width), col: Math.round(col.width)};
  });
  // notebook outputs and code: as many rendered lines as text lines (no wrapping), and a
  // line wider than its box must be reachable by scrolling (nothing cut)
  const pres = [...document.querySelectorAll('.jp-OutputArea-output pre, .jp-InputArea-editor pre, .highlight-ipynb pre')].map(p => {
    const lines = p.textContent.replace(/\\n$/, '').split('\\n').length;
    const cs = getComputedStyle(p);
    const lh = parseFloat(cs.lineHeight) || 1.4 * parseFloat(cs.fontSize);
    const pad = parseFloat(cs.paddingTop) + parseFloat(cs.paddingBottom);
    const rendered = Math.round((p.clientHeight - pad) / lh);
    let scrolls = false;
    for (let e = p; e && e.tagName !== 'ARTICLE'; e = e.parentElement) {
      const o = getComputedStyle(e).overflowX;
      if (o === 'auto' || o === 'scroll') { scrolls = true; break; }
    }
    const wide = p.scrollWidth > p.clientWidth + 1;
    return {wraps: rendered > lines, cut: wide && !scrolls, wide, text: p.textContent.slice(0, 60)};
  });
  return {imgs, tables, pres, pageOverflow: document.documentElement.scrollWidth > window.innerWidth};
}"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("site")
    ap.add_argument("--screenshots", default=None)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

    handler = functools.partial(Quiet, directory=args.site)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
    failures = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=flags)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        for name in PAGES:
            page.goto(base + name, wait_until="load")
            r = page.evaluate(CHECK)
            bad_imgs = [i["src"] for i in r["imgs"] if not i["ok"]]
            cut = [t for t in r["tables"] if not t["fits"] and not t["scrolls"]]
            wide = sum(not t["fits"] for t in r["tables"])
            print(
                f"{name}: {len(r['imgs'])} images ({len(bad_imgs)} not loaded), "
                f"{len(r['tables'])} tables ({wide} wider than the column, all of them "
                f"scrolling: {not cut}), page overflows the window: {r['pageOverflow']}"
            )
            wrapped = [p["text"] for p in r["pres"] if p["wraps"] or p["cut"]]
            if r["pres"]:
                print(
                    f"  {len(r['pres'])} notebook code/output blocks: {len(wrapped)} wrapped or "
                    f"cut, {sum(p['wide'] for p in r['pres'])} scroll sideways"
                    + "".join(f"\n    wrapped or cut: {t!r}" for t in wrapped)
                )
            must_fit = name.startswith(("benchmarks/", "optim/"))
            if bad_imgs or cut or r["pageOverflow"] or (must_fit and wide) or wrapped:
                failures.append(name)
            if args.screenshots:
                out = pathlib.Path(args.screenshots) / (name.replace("/", "_") + ".png")
                out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(out), full_page=False)
        browser.close()
    server.shutdown()
    print("FAILED: " + ", ".join(failures) if failures else "all pages pass")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
