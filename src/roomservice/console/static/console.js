// room-service console: the little script the pages use. Everything works without it, except live progress.
(function () {
  "use strict";

  // "select every row on this page"
  var all = document.getElementById("select-all");
  if (all) {
    all.addEventListener("change", function () {
      var boxes = document.querySelectorAll('table.rows input[type="checkbox"][name]');
      for (var i = 0; i < boxes.length; i++) {
        if (!boxes[i].disabled) { boxes[i].checked = all.checked; }
      }
    });
  }

  // a replay job's progress: poll its JSON until it is finished
  var job = document.getElementById("job");
  if (job && job.dataset.state === "running") {
    var url = job.dataset.jobUrl;
    var show = function (data) {
      document.getElementById("job-state").textContent = data.state;
      document.getElementById("job-done").textContent = data.done;
      document.getElementById("job-total").textContent = data.total;
      var bar = document.getElementById("job-progress");
      bar.max = data.total || 1;
      bar.value = data.done;
      var s = data.summary || {};
      if (data.state !== "running") {
        var text = data.error ? data.error : (s.text || "");
        document.getElementById("job-summary").textContent = text;
        job.dataset.state = data.state;
      }
    };
    var poll = function () {
      fetch(url, { credentials: "same-origin", headers: { "Accept": "application/json" } })
        .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
        .then(function (data) {
          show(data);
          if (data.state === "running") { setTimeout(poll, 500); }
        })
        .catch(function (status) {
          if (status === 403 || status === 404) {  // signed out, or a process that does not know the job
            document.getElementById("job-state").textContent = "unknown here";
            document.getElementById("job-summary").textContent = status === 404
              ? "This process no longer knows the job (restarted, or another replica): see the audit."
              : "Signed out: sign in again to follow the job.";
            return;
          }
          setTimeout(poll, 2000);  // the network or the server, for a moment
        });
    };
    setTimeout(poll, 300);
  }
})();
