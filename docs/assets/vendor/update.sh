#!/usr/bin/env bash
# Re-vendor the browser libraries the site uses, from the npm registry, so that the built site needs no network:
# Mermaid (diagrams, loaded by mkdocs-material when a page has a ```mermaid block) and KaTeX (the math that
# pymdownx.arithmatex marks, and the $…$ math of the tutorials). Run from anywhere; needs npm. Bump the versions
# here, run it, build the site, run the browser test (tests/docs/test_site_in_browser.py), commit.
set -euo pipefail
MERMAID=11.17.2
KATEX=0.19.1
here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
npm pack --silent "mermaid@$MERMAID" "katex@$KATEX" >/dev/null
mkdir mermaid katex
tar xzf "mermaid-$MERMAID.tgz" -C mermaid --strip-components 1
tar xzf "katex-$KATEX.tgz" -C katex --strip-components 1

rm -rf "$here/mermaid" "$here/katex"
mkdir -p "$here/mermaid" "$here/katex/contrib" "$here/katex/fonts"
cp mermaid/dist/mermaid.min.js mermaid/LICENSE "$here/mermaid/"
cp katex/dist/katex.min.js katex/dist/katex.min.css katex/LICENSE "$here/katex/"
cp katex/dist/contrib/auto-render.min.js "$here/katex/contrib/"
# Only the woff2 fonts: katex.min.css lists woff2 first, and every browser that runs mermaid 11 reads woff2, so
# the woff/ttf fallbacks would never be requested.
cp katex/dist/fonts/*.woff2 "$here/katex/fonts/"
echo "mermaid $MERMAID, katex $KATEX -> $here"
