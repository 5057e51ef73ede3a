// Requests to the server, with the API key asked for once when the server answers 401.
// The key stays in this tab's sessionStorage: never sent anywhere but this server.

const KEY_STORAGE = "pagellm.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

function headers(extra) {
  const h = { ...extra };
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// Shows the key dialog (#key-dialog in the page) and resolves once a key is entered.
function askForKey(message) {
  const dialog = document.getElementById("key-dialog");
  const input = dialog.querySelector("input");
  dialog.querySelector(".key-error").textContent = message;
  input.value = "";
  return new Promise((resolve) => {
    dialog.querySelector("form").onsubmit = (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY_STORAGE, input.value.trim());
      dialog.close();
      resolve();
    };
    dialog.showModal();
    input.focus();
  });
}

// fetch() with the key; on 401 asks for it (again) and retries.
export async function apiFetch(path, options = {}) {
  for (;;) {
    const response = await fetch(path, { ...options, headers: headers(options.headers) });
    if (response.status !== 401) return response;
    await askForKey(apiKey() ? "That key was refused: try again." : "This server needs an API key.");
  }
}

// The error message of an OpenAI-shaped error response (or its status line).
export async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// The light/dark theme, remembered in localStorage; the system's preference until chosen.
export function setupTheme(button) {
  const saved = localStorage.getItem("pagellm.theme");
  const dark = saved ? saved === "dark" : matchMedia("(prefers-color-scheme: dark)").matches;
  document.documentElement.dataset.theme = dark ? "dark" : "light";
  button.addEventListener("click", () => {
    const next = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
    document.documentElement.dataset.theme = next;
    localStorage.setItem("pagellm.theme", next);
  });
}
