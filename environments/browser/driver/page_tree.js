// The page as accessibility-tree-like lines, computed in the page (Playwright's own snapshot has no stable ids).
// Interactive elements get ids 1, 2, ... in document order and a data-sf-id attribute that actions look up, so the
// same page always yields the same ids. Text is merged up to block boundaries, so a sentence stays one line.
// Returns {items: [{y, line}], scrollY, viewport, height}: y (page offset) lets the driver show the part near the
// current scroll position.
() => {
  const INTERACTIVE = "a[href], button, input:not([type=hidden]), select, textarea, [role=button], [role=link]";
  const SKIP = new Set(["SCRIPT", "STYLE", "NOSCRIPT", "TEMPLATE", "HEAD", "TITLE", "META", "LINK"]);
  const norm = (s) => (s || "").replace(/\s+/g, " ").trim();
  const quote = (s) => JSON.stringify(norm(s));
  const items = [];
  let next = 1;
  let buffer = [], bufferY = 0, bufferRole = "text";

  document.querySelectorAll("[data-sf-id]").forEach((el) => el.removeAttribute("data-sf-id"));

  const hidden = (el) => {
    const style = getComputedStyle(el);
    return style.display === "none" || style.visibility === "hidden" || el.hidden;
  };
  const top = (el) => el.getBoundingClientRect().top + window.scrollY;
  const flush = () => {
    const text = norm(buffer.join(" "));
    if (text) items.push({ y: bufferY, line: `${bufferRole} ${JSON.stringify(text)}` });
    buffer = [];
  };
  const labelOf = (el) => {
    const aria = el.getAttribute("aria-label");
    if (aria) return aria;
    if (el.labels && el.labels.length) return el.labels[0].innerText;
    return el.getAttribute("placeholder") || el.getAttribute("title") || el.getAttribute("name") || "";
  };
  const describe = (el) => {
    const tag = el.tagName;
    const type = (el.getAttribute("type") || "").toLowerCase();
    const state = el.disabled ? " disabled" : "";
    if (tag === "A" || el.getAttribute("role") === "link") return `link ${quote(el.innerText || labelOf(el))}${state}`;
    if (tag === "BUTTON" || el.getAttribute("role") === "button" || ["submit", "button", "reset"].includes(type))
      return `button ${quote(el.innerText || el.value || labelOf(el))}${state}`;
    if (tag === "SELECT") {
      const options = Array.from(el.options).map((o) => norm(o.text));
      const chosen = el.selectedIndex >= 0 ? norm(el.options[el.selectedIndex].text) : "";
      return `combobox ${quote(labelOf(el))} value=${JSON.stringify(chosen)} options: ${options.join(" | ")}${state}`;
    }
    if (type === "checkbox" || type === "radio")
      return `${type} ${quote(labelOf(el))} ${el.checked ? "checked" : "unchecked"}${state}`;
    const role = type === "number" ? "spinbutton" : "textbox";
    return `${role} ${quote(labelOf(el))} value=${JSON.stringify(el.value)}${state}`;
  };
  const walk = (node, role) => {
    for (const child of node.childNodes) {
      if (child.nodeType === Node.TEXT_NODE) {
        const text = norm(child.textContent);
        if (text) {
          if (!buffer.length) { bufferY = top(node); bufferRole = role; }
          buffer.push(text);
        }
        continue;
      }
      if (child.nodeType !== Node.ELEMENT_NODE || SKIP.has(child.tagName) || hidden(child)) continue;
      if (child.matches(INTERACTIVE)) {
        flush();
        const id = next++;
        child.setAttribute("data-sf-id", String(id));
        items.push({ y: top(child), line: `[${id}] ${describe(child)}` });
        continue;
      }
      // A table row without controls is one line: "row "Tea mug | 2 | $6.00"".
      if (child.tagName === "TR" && !child.querySelector(INTERACTIVE)) {
        flush();
        const cells = Array.from(child.cells).map((c) => norm(c.innerText)).join(" | ");
        if (norm(cells.replace(/\|/g, ""))) items.push({ y: top(child), line: `row ${JSON.stringify(cells)}` });
        continue;
      }
      // A label's text is its control's name already.
      if (child.tagName === "LABEL" && child.control) continue;
      const block = !getComputedStyle(child).display.startsWith("inline");
      if (block) flush();
      walk(child, /^H[1-6]$/.test(child.tagName) ? "heading" : block ? "text" : role);
      if (block) flush();
    }
  };
  if (document.body) walk(document.body, "text");
  flush();
  return {
    items,
    scrollY: window.scrollY,
    viewport: window.innerHeight,
    height: document.documentElement.scrollHeight,
  };
}
