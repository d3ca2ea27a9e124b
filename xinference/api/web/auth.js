// Signing in, for a server with authentication on. Loaded before app.js: it wraps
// fetch so that every call the page makes to its own server carries the access
// token, and a 401 brings the sign-in dialog back. On first run (no admin yet) the
// dialog creates the admin instead. The token lives in sessionStorage: it goes
// when the tab closes, and the server's expiry bounds it anyway.
"use strict";

(() => {
  const TOKEN = "xinference-access-token";
  const plainFetch = window.fetch.bind(window);
  let dialog = null;
  let mode = "login"; // or "setup"

  const token = () => sessionStorage.getItem(TOKEN);
  const sameOrigin = (input) =>
    new URL(input instanceof Request ? input.url : input, location.href).origin === location.origin;

  window.fetch = async (input, init = {}) => {
    if (!sameOrigin(input) || !token()) return plainFetch(input, init);
    const headers = new Headers(init.headers || (input instanceof Request ? input.headers : {}));
    if (!headers.has("Authorization")) headers.set("Authorization", `Bearer ${token()}`);
    const response = await plainFetch(input, { ...init, headers });
    if (response.status === 401) {
      sessionStorage.removeItem(TOKEN);
      show("login", "Your session ended: sign in again.");
    }
    return response;
  };

  function field(id, label, type, autocomplete) {
    const wrap = document.createElement("div");
    wrap.className = "field";
    const caption = document.createElement("label");
    caption.htmlFor = id;
    caption.textContent = label;
    const input = document.createElement("input");
    Object.assign(input, { id, name: id, type, required: true, autocomplete });
    wrap.append(caption, input);
    return wrap;
  }

  function build() {
    dialog = document.createElement("dialog");
    dialog.id = "auth-dialog";
    dialog.setAttribute("aria-labelledby", "auth-heading");
    dialog.innerHTML = `<form id="auth-form" method="dialog" novalidate>
      <h2 id="auth-heading"></h2><p id="auth-hint" class="hint"></p>
      <div id="auth-fields"></div>
      <p class="form-error" id="auth-error" role="alert"></p>
      <button type="submit" id="auth-submit"></button></form>`;
    document.body.append(dialog);
    dialog.addEventListener("cancel", (event) => event.preventDefault()); // no Esc out
    dialog.querySelector("form").addEventListener("submit", submit);
  }

  function show(which, message = "") {
    if (!dialog) build();
    mode = which;
    const setup = which === "setup";
    dialog.querySelector("#auth-heading").textContent = setup ? "Create the admin" : "Sign in";
    dialog.querySelector("#auth-hint").textContent = setup
      ? "First run: this server has no admin yet. The account you create here may do everything."
      : "This server needs you to sign in.";
    const fields = dialog.querySelector("#auth-fields");
    fields.replaceChildren(
      field("auth-username", "Username", "text", "username"),
      field("auth-password", "Password", "password", setup ? "new-password" : "current-password"),
      ...(setup ? [field("auth-confirm", "Repeat the password", "password", "new-password")] : []),
    );
    dialog.querySelector("#auth-submit").textContent = setup ? "Create admin" : "Sign in";
    dialog.querySelector("#auth-error").textContent = message;
    if (!dialog.open) dialog.showModal();
    dialog.querySelector("#auth-username").focus();
  }

  async function submit(event) {
    event.preventDefault();
    const value = (id) => dialog.querySelector(`#${id}`).value;
    const error = dialog.querySelector("#auth-error");
    const body = { username: value("auth-username"), password: value("auth-password") };
    if (mode === "setup" && body.password !== value("auth-confirm")) {
      error.textContent = "The two passwords differ.";
      return;
    }
    const path = mode === "setup" ? "/v1/admin/setup" : "/token";
    const response = await plainFetch(path, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    const data = await response.json().catch(() => ({}));
    if (!response.ok) {
      const detail = typeof data.detail === "string" ? data.detail : "check the fields";
      error.textContent = `${mode === "setup" ? "Not created" : "Not signed in"}: ${detail}`;
      return;
    }
    sessionStorage.setItem(TOKEN, data.access_token);
    dialog.close();
    signedIn(body.username);
  }

  function signedIn(name) {
    let bar = document.getElementById("auth-user");
    if (!bar) {
      bar = document.createElement("p");
      bar.id = "auth-user";
      const out = document.createElement("button");
      out.type = "button";
      out.textContent = "Sign out";
      out.addEventListener("click", () => {
        sessionStorage.removeItem(TOKEN);
        sessionStorage.removeItem(`${TOKEN}-user`);
        bar.remove();
        show("login");
      });
      bar.append(document.createElement("span"), out);
      document.querySelector("header").append(bar);
    }
    sessionStorage.setItem(`${TOKEN}-user`, name);
    bar.querySelector("span").textContent = `Signed in as ${name} `;
  }

  async function start() {
    const response = await plainFetch("/v1/admin/setup/status");
    if (!response.ok) return; // a server without these routes: nothing to do
    const status = await response.json();
    if (!status.auth) return;
    if (status.needs_setup) show("setup");
    else if (!token()) show("login");
    else signedIn(sessionStorage.getItem(`${TOKEN}-user`) || "?");
  }

  document.addEventListener("DOMContentLoaded", start);
})();
