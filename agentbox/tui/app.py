"""`agentbox top`: a live Textual dashboard of agent sessions, cache residency and the machine.

Every `interval` seconds one poll runs in a worker thread (HTTP to the server, psutil / NVML locally) and
the panels are redrawn from its snapshot. A poll never overlaps the previous one, and a down server is
polled at the same interval — the dashboard waits, it never spins. Everything is reachable from the
keyboard (no mouse over SSH): arrows move the session cursor, enter opens, d closes, s sorts, / filters."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Input, Static

from agentbox.tui import DEFAULT_INTERVAL_S, panels, session_table
from agentbox.tui.snapshot import Poller


class SessionTable(DataTable):
    """The session table; enter opens the selected session (shown in the footer, unlike DataTable's own)."""

    BINDINGS = [Binding("enter", "select_cursor", "detail", show=True)]


class ConfirmScreen(ModalScreen[bool]):
    """y / enter confirms, n / escape cancels."""

    BINDINGS = [Binding("y,enter", "answer(True)", "yes"), Binding("n,escape", "answer(False)", "no")]
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Static { width: 64; padding: 1 2; border: thick $error; background: $surface; }
    """

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        yield Static(Text.assemble(self.question, "\n\n", ("y", "bold"), " yes   ", ("n", "bold"), " no"))

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class DetailScreen(ModalScreen[None]):
    """One session's turns: prompt and cached tokens, hit rate and time to first token per turn."""

    BINDINGS = [Binding("escape,q,enter", "app.pop_screen", "back")]
    DEFAULT_CSS = """
    DetailScreen { align: center middle; }
    DetailScreen > VerticalScroll { width: 90%; height: 80%; border: thick $accent; background: $surface;
                                    padding: 0 1; }
    """

    def __init__(self, detail: dict[str, Any] | None, sid: str) -> None:
        super().__init__()
        self.detail = detail
        self.sid = sid

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            if self.detail is None:
                yield Static(f"session {self.sid}: no detail (gone, or the server has no /v1/sessions/ID)",
                             id="detail")
            else:
                app: Any = self.app  # TopApp: the device names a column, the width picks the columns
                yield Static(session_table.sessions_table([self.detail],
                                                          device=session_table.engine_device(app.snap or {}),
                                                          width=int(app.size.width * 0.9) - 4,
                                                          optional=session_table.optional_columns(app.snap or {})),
                             id="detail-summary")
                yield Static(session_table.turns_table(self.detail), id="detail")
            yield Static(Text("escape: back", style="dim"))


# Layouts by terminal size. From SIDE_WIDTH columns the panels stand right of the table (RIGHT_WIDTH wide) and
# the table keeps about 100 columns, every usual one; below it the table takes the whole width and the panels
# stack under it: all three from TALL_HEIGHT rows (120x40 shows every column above them), else one at a time
# (80x24: v shows the next). The table's columns are what fits its width (session_table.session_columns).
SIDE_WIDTH = 160
RIGHT_WIDTH = 58
TALL_HEIGHT = 40
TABLE_FRAME = 2  # the table's scrollbar


class TopApp(App[None]):
    TITLE = "agentbox top"
    ENABLE_COMMAND_PALETTE = False  # its footer entry pushed "q quit" off an 80-column footer
    CSS = f"""
    Screen {{ layout: vertical; }}
    #header {{ height: 1; background: $boost; }}
    #down {{ height: auto; padding: 1 2; display: none; }}
    #main {{ height: 1fr; }}
    #left {{ width: 1fr; }}
    #sessions {{ height: 1fr; }}
    #filter {{ display: none; }}
    #right {{ width: {RIGHT_WIDTH}; }}
    .panel {{ height: auto; border: round $primary; padding: 0 1; }}
    Screen.stacked #main {{ layout: vertical; }}
    Screen.stacked #left {{ width: 1fr; height: 1fr; }}
    Screen.stacked #right {{ width: 1fr; height: auto; }}
    Screen.cycle #right > .panel {{ display: none; }}
    Screen.cycle #right > .panel.shown {{ display: block; }}
    """
    PANELS = (("pool", "KV pool"), ("rates", "rates"), ("machine", "machine"))
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),  # as in top(1), not Textual's ctrl+q hint
        Binding("s", "sort", "sort"),
        Binding("slash", "filter", "filter"),
        Binding("d", "close_session", "close"),
        Binding("p", "pause", "pause"),
        Binding("v", "next_panel", "panel"),
    ]

    def __init__(self, url: str, interval: float = DEFAULT_INTERVAL_S, api_key: str | None = None) -> None:
        super().__init__()
        self.url = url.rstrip("/")
        self.interval = max(0.1, interval)
        self.poller = Poller(self.url, api_key=api_key)
        self.snap: dict[str, Any] | None = None
        self.paused = False
        self.sort_index = 0
        self.filter_text = ""
        self.polls = 0  # completed polls, for tests and the screenshot script to wait on
        self._polling = False
        self.stacked = False  # the panels under the table (below SIDE_WIDTH)
        self.cycling = False  # one panel at a time under it (stacked and below TALL_HEIGHT)
        self.panel_index = 0  # the panel shown when cycling
        self.columns = session_table.session_columns()
        self._columns_for: tuple[Any, ...] | None = None  # (device, width, optional) the columns were built for

    # ---- layout ----

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        yield Static(id="down")
        with Horizontal(id="main"):
            with Vertical(id="left"):
                yield SessionTable(id="sessions", cursor_type="row", zebra_stripes=True)
                yield Input(placeholder="filter by id, client or state; enter applies, escape clears", id="filter")
            with Vertical(id="right"):
                yield Static(id="pool", classes="panel")
                yield Static(id="rates", classes="panel")
                yield Static(id="machine", classes="panel")
        yield Footer()

    def on_mount(self) -> None:
        self._fit_layout()
        self._build_columns()
        self.query_one("#sessions", DataTable).focus()
        self.query_one("#header", Static).update(panels.header({"url": self.url}, width=self.size.width))
        self.set_interval(self.interval, self.poll)
        self.poll()

    def on_resize(self) -> None:
        self._fit_layout()
        self.refresh_view()

    def _fit_layout(self) -> None:
        stacked = self.size.width < SIDE_WIDTH
        cycling = stacked and self.size.height < TALL_HEIGHT
        if (stacked, cycling) != (self.stacked, self.cycling):
            self.stacked, self.cycling = stacked, cycling
            self.screen.set_class(stacked, "stacked")
            self.screen.set_class(cycling, "cycle")
            self.refresh_bindings()
        for i, (pid, name) in enumerate(self.PANELS):
            panel = self.query_one(f"#{pid}", Static)
            panel.set_class(i == self.panel_index, "shown")
            panel.border_title = f"{name} ({i + 1}/{len(self.PANELS)}, v: next)" if cycling else None

    def table_width(self) -> int:
        """Columns the session table's cells have."""
        return self.size.width - (0 if self.stacked else RIGHT_WIDTH) - TABLE_FRAME

    def _build_columns(self, snap: dict[str, Any] | None = None) -> None:
        """(Re)build the table's columns when the device becomes known, the width changes or the server turns
        out to have an optional column's figures."""
        device = session_table.engine_device(snap) if snap else None
        optional = session_table.optional_columns(snap) if snap else frozenset()
        key = (device, self.table_width(), optional)
        if self._columns_for == key:
            return
        self._columns_for = key
        self.columns = session_table.session_columns(device, self.table_width(), optional)
        self.sort_index = min(self.sort_index, len(self.columns) - 1)
        table = self.query_one("#sessions", DataTable)
        table.clear(columns=True)
        for c in self.columns:
            table.add_column(c.title, key=c.key)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return self.cycling if action == "next_panel" else True  # v only where panels take turns

    # ---- polling ----

    def poll(self) -> None:
        if self.paused or self._polling:
            return
        self._polling = True
        self.run_worker(self._poll_thread, thread=True, group="poll", exit_on_error=False)

    def _poll_thread(self) -> None:
        try:
            snap = self.poller.poll()
        except Exception as exc:  # a bug in a probe must not kill the dashboard; show it as an error
            snap = {"url": self.url, "up": False, "error": f"{type(exc).__name__}: {exc}"}
        try:
            self.call_from_thread(self._show, snap)
        except RuntimeError:  # the app is shutting down
            self._polling = False

    def _show(self, snap: dict[str, Any]) -> None:
        self._polling = False
        self.snap = snap
        self.polls += 1
        self.refresh_view()

    def refresh_view(self) -> None:
        snap = self.snap
        if snap is None:
            return
        self.query_one("#header", Static).update(panels.header(snap, self.paused, self.size.width))
        down = self.query_one("#down", Static)
        main = self.query_one("#main")
        if not snap.get("up"):
            down.update(panels.down_message(snap, self.interval))
            down.display, main.display = True, False
            return
        down.display, main.display = False, True
        self._build_columns(snap)
        self._fill_table(snap.get("sessions"))
        self.query_one("#pool", Static).update(panels.pool_panel(snap, width=min(52, max(20, self.size.width - 8))))
        self.query_one("#rates", Static).update(panels.rates_panel(snap, self.poller.rates.history))
        self.query_one("#machine", Static).update(panels.machine_panel(snap))

    def _fill_table(self, sessions: list[dict[str, Any]] | None) -> None:
        table = self.query_one("#sessions", DataTable)
        col = self.columns[self.sort_index]
        # Numbers sort largest first (the busiest session on top); names alphabetically.
        reverse = col.key not in ("id", "client", "state")
        rows = session_table.select_sessions(sessions or [], col.key, reverse, self.filter_text)
        selected = self.selected_session()
        table.clear()
        for s in rows:
            table.add_row(*(c.cell(s) for c in self.columns), key=str(s.get("id")))
        keys = [str(s.get("id")) for s in rows]
        if selected in keys:  # the cursor stays on its session across redraws and re-sorts
            table.move_cursor(row=keys.index(selected), animate=False)
        marker = "▼" if reverse else "▲"
        table.border_title = (f"sessions ({len(rows)}"
                              + (f" of {len(sessions or [])}, filter '{self.filter_text}'" if self.filter_text else "")
                              + f")  sorted by {col.title} {marker}"
                              + ("" if sessions is not None else "  – no /v1/sessions on this server"))

    def session_ids(self) -> list[str]:
        table = self.query_one("#sessions", DataTable)
        return [str(k.value) for k in table.rows]

    def selected_session(self) -> str | None:
        table = self.query_one("#sessions", DataTable)
        if table.row_count == 0:
            return None
        row = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        return None if row.value is None else str(row.value)

    # ---- actions ----

    def action_sort(self) -> None:
        self.sort_index = (self.sort_index + 1) % len(self.columns)
        self.refresh_view()

    def action_next_panel(self) -> None:
        self.panel_index = (self.panel_index + 1) % len(self.PANELS)
        self._fit_layout()

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.refresh_view()
        self.notify("paused: press p to resume" if self.paused else "resumed")

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.value = self.filter_text
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value
        self.refresh_view()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.input.display = bool(self.filter_text)
        self.query_one("#sessions", DataTable).focus()

    def on_key(self, event: Any) -> None:
        box = self.query_one("#filter", Input)
        if event.key == "escape" and box.has_focus:
            box.value = ""
            box.display = False
            self.query_one("#sessions", DataTable).focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open()

    def action_open(self) -> None:
        sid = self.selected_session()
        if sid is None or len(self.screen_stack) > 1:
            return
        self.run_worker(lambda: self._open_thread(sid), thread=True, group="detail", exit_on_error=False)

    def _open_thread(self, sid: str) -> None:
        try:
            detail = self.poller.api.session(sid)
        except Exception as exc:
            self.call_from_thread(self.notify, f"session {sid}: {exc}", severity="error")
            return
        self.call_from_thread(self.push_screen, DetailScreen(detail, sid))

    def action_close_session(self) -> None:
        sid = self.selected_session()
        if sid is None or len(self.screen_stack) > 1:
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.run_worker(lambda: self._delete_thread(sid), thread=True, group="delete", exit_on_error=False)

        self.push_screen(ConfirmScreen(f"Close session {sid}? Its own cached history is dropped."), confirmed)

    def _delete_thread(self, sid: str) -> None:
        try:
            out = self.poller.api.delete_session(sid)
        except Exception as exc:  # ServerDown, or an HTTP error status (e.g. 404: already gone)
            self.call_from_thread(self.notify, f"could not close {sid}: {exc}", severity="error")
            return
        self.call_from_thread(self.notify, f"closed {sid}: freed {out.get('freed_pages', '–')} pages")
        self.call_from_thread(self.poll)

    def on_unmount(self) -> None:
        self.poller.close()


def run(url: str, interval: float = DEFAULT_INTERVAL_S, api_key: str | None = None) -> None:
    TopApp(url, interval, api_key).run()
