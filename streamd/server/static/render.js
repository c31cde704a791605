// Model output -> DOM, safely. Markdown goes through marked (GFM) and the result through DOMPurify, which
// returns a DOM fragment: no string of model output is ever assigned to innerHTML. Raw HTML in the
// markdown is shown as text, images become links (a remote image would load without asking), and links
// open in a new tab without a referrer. Code blocks get a copy button (built here, not from the output).
"use strict";
(() => {
  const ALLOWED_TAGS = ["a", "b", "blockquote", "br", "code", "del", "em", "h1", "h2", "h3", "h4", "h5", "h6",
    "hr", "i", "input", "li", "ol", "p", "pre", "s", "strong", "sub", "sup", "table", "tbody", "td", "th",
    "thead", "tr", "ul"];
  const ALLOWED_ATTR = ["href", "title", "class", "start", "align", "type", "checked", "disabled"];
  const PURIFY = {ALLOWED_TAGS, ALLOWED_ATTR, ALLOW_DATA_ATTR: false, RETURN_DOM_FRAGMENT: true};

  const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

  marked.use({
    gfm: true,
    breaks: true,
    renderer: {
      html(token) { return escapeHtml(token.text); },  // raw HTML is shown, never interpreted
      image(token) { return `<a href="${escapeHtml(token.href)}">${escapeHtml(token.text || token.href)}</a>`; },
    },
  });

  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
    if (node.tagName === "INPUT" && node.getAttribute("type") !== "checkbox") node.remove();  // task lists only
  });

  // The sanitized fragment of `markdown`.
  function fragment(markdown) {
    return DOMPurify.sanitize(marked.parse(markdown), PURIFY);
  }

  function addCopyButtons(root) {
    for (const pre of root.querySelectorAll("pre")) {
      const button = document.createElement("button");
      button.type = "button";
      button.className = "copy-code";
      button.textContent = "Copy";
      button.addEventListener("click", () => copyText(pre.querySelector("code")?.textContent ?? pre.textContent, button));
      pre.appendChild(button);
    }
  }

  // Replaces el's children with the rendering of `markdown` (called on every delta while streaming).
  function into(el, markdown) {
    const frag = fragment(markdown);
    addCopyButtons(frag);
    el.replaceChildren(frag);
  }

  async function copyText(text, button) {
    try {
      await navigator.clipboard.writeText(text);
      flash(button, "Copied");
    } catch {
      flash(button, "Copy failed");
    }
  }

  function flash(button, label) {
    const before = button.dataset.label || button.textContent;
    button.dataset.label = before;
    button.textContent = label;
    setTimeout(() => { button.textContent = before; }, 1500);
  }

  window.streamdRender = {into, copyText};
})();
