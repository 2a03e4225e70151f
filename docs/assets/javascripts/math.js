// Typeset the site's math with the vendored KaTeX (docs/assets/vendor/katex), in the reader's browser, offline.
//
// Pages: pymdownx.arithmatex (generic mode) wraps every formula of a Markdown page in an element of class
// "arithmatex" holding \( … \) or \[ … \]; only those elements are typeset, so a dollar sign in prose or code is
// never mistaken for math. Tutorials: the notebooks' Markdown cells write $…$ and $$…$$ as Jupyter does; inside a
// rendered notebook (class "jupyter-wrapper") those delimiters are typeset too, code cells excepted.
// document$ is mkdocs-material's page observable: it fires on the first load and after every instant navigation.
const pageDelimiters = [
  { left: "\\(", right: "\\)", display: false },
  { left: "\\[", right: "\\]", display: true },
];
const notebookDelimiters = [
  { left: "$$", right: "$$", display: true },
  { left: "$", right: "$", display: false },
  ...pageDelimiters,
];

document$.subscribe(({ body }) => {
  for (const el of body.querySelectorAll(".arithmatex")) {
    renderMathInElement(el, { delimiters: pageDelimiters, throwOnError: true });
  }
  for (const el of body.querySelectorAll(".jupyter-wrapper .jp-MarkdownCell")) {
    renderMathInElement(el, { delimiters: notebookDelimiters, throwOnError: true });
  }
});
